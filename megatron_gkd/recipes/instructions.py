"""Short instructions with checkable answers, generated offline: the prompts of the pruning example
(``configs/smollm2_prune_cpu.yaml``) and of tests that need a real chat model's kind of prompt.

Six kinds of question, each from a table of facts the project writes down here and two or three phrasings: a
country's capital, a word's opposite, a noun's plural, a verb's past tense, the colour of a thing, and a count
(days in a week). A record is one user message (the model's chat template adds its system prompt) with the answer
and its kind as ``group``, so an eval reports each kind's accuracy with ``eval.scorer=contains`` (a chatty "The
capital of France is Paris." counts). Train and eval split the *facts*, not the phrasings: a held-out question asks
for a fact no training prompt asked for, so what an eval measures is what the student keeps of the teacher's
knowledge and manner, not what it memorised from the prompts.

    python -m megatron_gkd.recipes.instructions --out outputs/instructions    # train.jsonl, eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib

import numpy as np

from megatron_gkd.log_setup import setup_logging

logger = logging.getLogger(__name__)

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Germany": "Berlin", "Spain": "Madrid",
    "the United Kingdom": "London", "Russia": "Moscow", "China": "Beijing", "Egypt": "Cairo", "Greece": "Athens",
    "Canada": "Ottawa", "Australia": "Canberra", "India": "Delhi", "Mexico": "Mexico City", "Portugal": "Lisbon",
    "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw",
    "Austria": "Vienna", "Hungary": "Budapest", "Turkey": "Ankara", "Argentina": "Buenos Aires", "Peru": "Lima",
    "Kenya": "Nairobi", "Thailand": "Bangkok", "South Korea": "Seoul", "Vietnam": "Hanoi", "Cuba": "Havana",
    "Denmark": "Copenhagen", "the Netherlands": "Amsterdam", "Belgium": "Brussels", "Switzerland": "Bern",
    "the Czech Republic": "Prague", "Iran": "Tehran", "Iraq": "Baghdad", "Chile": "Santiago", "Indonesia": "Jakarta",
    "the Philippines": "Manila", "Scotland": "Edinburgh", "Nigeria": "Abuja",
}
OPPOSITES = {
    "hot": "cold", "up": "down", "big": "small", "fast": "slow", "happy": "sad", "light": "dark", "open": "closed",
    "early": "late", "full": "empty", "high": "low", "hard": "soft", "long": "short", "rich": "poor", "wet": "dry",
    "strong": "weak", "thick": "thin", "loud": "quiet", "left": "right", "day": "night", "black": "white",
    "good": "bad", "true": "false", "win": "lose", "push": "pull", "first": "last", "inside": "outside",
    "above": "below", "near": "far", "clean": "dirty", "alive": "dead", "asleep": "awake", "before": "after",
    "friend": "enemy", "buy": "sell", "north": "south", "east": "west", "young": "old", "love": "hate",
}
PLURALS = {
    "mouse": "mice", "child": "children", "man": "men", "woman": "women", "tooth": "teeth", "foot": "feet",
    "goose": "geese", "person": "people", "box": "boxes", "baby": "babies", "leaf": "leaves", "knife": "knives",
    "wolf": "wolves", "city": "cities", "bus": "buses", "sheep": "sheep", "ox": "oxen", "potato": "potatoes",
    "hero": "heroes", "church": "churches", "wife": "wives", "fox": "foxes", "story": "stories", "dish": "dishes",
    "half": "halves", "country": "countries", "glass": "glasses", "life": "lives",
}
PAST_TENSES = {
    "go": "went", "eat": "ate", "run": "ran", "see": "saw", "write": "wrote", "take": "took", "give": "gave",
    "come": "came", "drink": "drank", "swim": "swam", "sing": "sang", "buy": "bought", "think": "thought",
    "bring": "brought", "teach": "taught", "catch": "caught", "sleep": "slept", "speak": "spoke", "break": "broke",
    "fly": "flew", "know": "knew", "grow": "grew", "throw": "threw", "drive": "drove", "ride": "rode",
    "fall": "fell", "begin": "began", "forget": "forgot", "choose": "chose", "wear": "wore", "find": "found",
    "feel": "felt",
}
COLOURS = {
    "the sky on a clear day": "blue", "grass": "green", "snow": "white", "coal": "black", "a ripe banana": "yellow",
    "a ripe tomato": "red", "milk": "white", "blood": "red", "a lemon": "yellow", "a carrot": "orange",
    "chocolate": "brown", "an emerald": "green", "a ruby": "red", "a sapphire": "blue", "a pumpkin": "orange",
    "charcoal": "black", "a ripe strawberry": "red", "a lime": "green", "the sun in a child's drawing": "yellow",
    "a polar bear": "white", "a crow": "black", "a frog": "green",
}
COUNTS = {
    "days are in a week": "7", "hours are in a day": "24", "months are in a year": "12",
    "minutes are in an hour": "60", "legs does a dog have": "4", "legs does a spider have": "8",
    "legs does an insect have": "6", "sides does a triangle have": "3", "sides does a square have": "4",
    "sides does a hexagon have": "6", "wheels does a bicycle have": "2", "continents are there on Earth": "7",
    "planets are in the solar system": "8", "weeks are in a year": "52", "cents are in a dollar": "100",
    "players are on a soccer team on the field": "11", "strings does a standard guitar have": "6",
    "days are in a leap year": "366", "seconds are in a minute": "60", "letters are in the English alphabet": "26",
}
KINDS = {
    "capital": (CAPITALS, ["What is the capital of {x}?", "Name the capital city of {x}.",
                           "Which city is the capital of {x}? Answer briefly."]),
    "opposite": (OPPOSITES, ["What is the opposite of \"{x}\"?", "Give the antonym of the word \"{x}\".",
                             "What word means the opposite of {x}? Answer in one word."]),
    "plural": (PLURALS, ["What is the plural of \"{x}\"?", "Write the plural form of the noun \"{x}\".",
                         "One {x}, two ...? Give the plural."]),
    "past_tense": (PAST_TENSES, ["What is the past tense of \"{x}\"?", "Write the simple past of the verb \"{x}\".",
                                 "Yesterday I ... ({x}). Which form of the verb fills the gap?"]),
    "colour": (COLOURS, ["What colour is {x}?", "What is the usual colour of {x}? Answer in one word."]),
    "count": (COUNTS, ["How many {x}?", "Answer with a number: how many {x}?"]),
}


def make_records(*, eval_fraction: float = 0.25, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Training and held-out records: per kind, a seeded ``eval_fraction`` of its facts is held out; every phrasing
    of a training fact is a training record, every phrasing of a held-out fact an eval record. A record is
    ``{"messages": [{"role": "user", "content": ...}], "answer": ..., "group": kind}``; the training records are
    shuffled (a step's prompts mix the kinds)."""
    rng = np.random.default_rng(seed)
    train, held_out = [], []
    for kind, (facts, phrasings) in KINDS.items():
        keys = sorted(facts)
        order = rng.permutation(len(keys))
        num_eval = max(1, round(eval_fraction * len(keys)))
        for rank, index in enumerate(order):
            subject = keys[index]
            target = held_out if rank < num_eval else train
            for phrasing in phrasings:
                target.append({"messages": [{"role": "user", "content": phrasing.format(x=subject)}],
                               "answer": facts[subject], "group": kind})
    train = [train[i] for i in rng.permutation(len(train))]
    return train, held_out


def build_prompts(out: pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """Writes ``train.jsonl`` and ``eval.jsonl`` under ``out``; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = make_records(seed=seed)
    for name, records in (("train", train), ("eval", held_out)):
        with open(out / f"{name}.jsonl", "w") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in records)
    logger.info("instructions: %d training and %d held-out prompts in %s", len(train), len(held_out), out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("outputs/instructions"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    setup_logging("INFO")
    build_prompts(args.out, seed=args.seed)


if __name__ == "__main__":
    main()

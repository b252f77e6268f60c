"""Which of the demo's two skills a student has: the carries of the worked part, and copying that part reversed.

    python benchmarks/demo_skills.py RUN_DIR/hf/step_1200 assets/demo/student     # per-part accuracy of exports
    python benchmarks/demo_skills.py --teacher-copy                                # the teacher on wrong worked parts

A demo response is ``worked #### answer`` (``1 6 7 1 #### 1 7 6 1``, megatron_gkd/recipes/arithmetic.py): the
worked part writes the sum from the units up (the carries), the answer is the worked part reversed (a copy by
position). The trainer's eval scores only the answer; this splits it, from greedy answers of an HF export on the
held-out problems: ``worked`` (the worked part is the reference's), ``copy`` (the answer is the model's *own*
worked part reversed, right or wrong) and ``final`` (the answer is right: the trainer's ``eval/accuracy``).

``--teacher-copy`` asks what the teacher's distribution teaches after a worked part the student got wrong, as an
on-policy sample of a plateau student is: teacher-forced on the reference worked part, on it with one digit
changed, and with every digit random, the share of greedy teacher answers that copy the given worked part and
the teacher's mean probability of the copy's first digit.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import random

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from megatron_gkd.recipes import arithmetic

logger = logging.getLogger(__name__)

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEACHER = ROOT / "assets" / "demo" / "teacher"


def _load(path: pathlib.Path):
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tokenizer, model


@torch.no_grad()
def _greedy(tokenizer, model, ids: list[int], max_new_tokens: int = 12) -> list[str]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                         eos_token_id=model.config.eos_token_id)
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True).split()


def skills(path: pathlib.Path, records: list[dict]) -> dict[str, float]:
    """Shares of ``records`` whose greedy response has the right worked part, copies its own worked part, is right."""
    tokenizer, model = _load(path)
    worked = copy = final = 0
    for record in records:
        words = _greedy(tokenizer, model, tokenizer.encode(record["prompt"]))
        own, _, answer = " ".join(words).partition("####")
        reference_worked, _, reference_answer = record["response"].partition("####")
        worked += own.split() == reference_worked.split()
        copy += answer.split() == own.split()[::-1]
        final += answer.split() == reference_answer.split()
    return {name: count / len(records) for name, count in (("worked", worked), ("copy", copy), ("final", final))}


@torch.no_grad()
def teacher_copy(records: list[dict], seed: int = 0) -> dict[str, tuple[float, float]]:
    """Per corruption of the worked part: (greedy teacher answers that copy it, mean p(the copy's first digit))."""
    tokenizer, model = _load(TEACHER)
    rng = random.Random(seed)
    results = {}
    for corruption in ("none", "one digit", "every digit"):
        copies, probability = 0, 0.0
        for record in records:
            worked = record["response"].partition("####")[0].split()
            changed = {"none": [], "one digit": [rng.randrange(len(worked))], "every digit": range(len(worked))}
            for index in changed[corruption]:
                worked[index] = str((int(worked[index]) + rng.randrange(1, 10)) % 10)
            ids = tokenizer.encode(record["prompt"]) + tokenizer.encode(" ".join(worked) + " ####")
            copies += _greedy(tokenizer, model, ids, max_new_tokens=len(worked))[:len(worked)] == worked[::-1]
            next_token = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
            probability += next_token[tokenizer.convert_tokens_to_ids(worked[-1])].item()
        results[corruption] = (copies / len(records), probability / len(records))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", type=pathlib.Path, help="HF exports (a run's hf/step_N) to split")
    parser.add_argument("--teacher-copy", action="store_true", help="the teacher on corrupted worked parts")
    parser.add_argument("--task", type=pathlib.Path, default=ROOT / "outputs" / "demo_task",
                        help="the task files (built here if missing)")
    parser.add_argument("--num-problems", type=int, default=500)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)  # beside the runs on a 2-core machine
    if not (args.task / "eval.jsonl").exists():
        arithmetic.build_task(args.task)
    records = [json.loads(line) for line in (args.task / "eval.jsonl").read_text().splitlines()][:args.num_problems]
    for path in args.models:
        shares = skills(path, records)
        logger.info("%s: worked part right %.3f, answer = own worked part reversed %.3f, answer right %.3f",
                    path, shares["worked"], shares["copy"], shares["final"])
    if args.teacher_copy:
        for corruption, (copies, probability) in teacher_copy(records).items():
            logger.info("teacher, worked part with %-11s changed: answer copies it %.3f, p(copy's first digit) %.3f",
                        corruption, copies, probability)


if __name__ == "__main__":
    main()

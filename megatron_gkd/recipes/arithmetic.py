"""The distillation demo's task: multi-digit addition with a short worked solution, generated from a seed.

A problem reads ``4 7 + 3 8 5 =`` (one token per digit) and its reference response writes the sum from
the units digit up, the order in which the carries flow, then the answer the usual way round after the
GSM8K-style marker ``####``::

    prompt    4 7 + 3 8 5 =
    response  2 3 4 #### 4 3 2

The worked part is what lets a two-layer model learn addition in minutes: every digit depends only on
two operand digits and the carry it has just written. The answer after ``####`` is checked exactly by
the ``final_answer`` scorer (:mod:`megatron_gkd.trainer.eval`). Train and eval problems are disjoint:
the eval set is drawn first and its pairs are excluded from the training draw.

The tokenizer is trained on the generated text with ``tokenizers`` (a word-level model over the
whitespace-separated symbols: digits, ``+``, ``=``, ``####``) and saved in HF format::

    python -m megatron_gkd.recipes.arithmetic --out outputs/arithmetic
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib

import numpy as np

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
MARKER = "####"


def _spell(number: int) -> str:
    return " ".join(str(number))


def problem(a: int, b: int) -> dict:
    """The record of ``a + b``: prompt, reference response (worked solution and answer) and answer."""
    total = a + b
    return {"prompt": f"{_spell(a)} + {_spell(b)} =",
            "response": f"{' '.join(reversed(str(total)))} {MARKER} {_spell(total)}",
            "answer": str(total)}


def make_problems(num_train: int, num_eval: int, *, max_value: int = 999, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``num_train`` training and ``num_eval`` held-out addition problems over ``0..max_value``,
    deterministic in ``seed``; no (a, b) pair of the eval set appears in the training set."""
    rng = np.random.default_rng(seed)
    space = (max_value + 1) ** 2
    if num_train + num_eval > space // 2:
        raise ValueError(f"{num_train + num_eval} problems asked from only {space} pairs; raise max_value")
    eval_pairs = rng.choice(space, size=num_eval, replace=False)
    held_out = set(eval_pairs.tolist())
    train_pairs = []
    while len(train_pairs) < num_train:
        for pair in rng.integers(0, space, size=num_train).tolist():
            if pair not in held_out and len(train_pairs) < num_train:
                train_pairs.append(pair)
    to_record = lambda pair: problem(*divmod(int(pair), max_value + 1))  # noqa: E731
    return [to_record(p) for p in train_pairs], [to_record(p) for p in eval_pairs]


def train_tokenizer(directory: str | pathlib.Path, texts: list[str]):
    """A word-level tokenizer trained on ``texts`` (whitespace-separated symbols), saved in HF format."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=1))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<unk>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def write_jsonl(path: pathlib.Path, records: list[dict]) -> pathlib.Path:
    with path.open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


def build_task(out: str | pathlib.Path, *, num_train: int = 20000, num_eval: int = 500, max_value: int = 999,
               seed: int = 0) -> pathlib.Path:
    """``train.jsonl``, ``eval.jsonl`` and ``tokenizer/`` under ``out`` (rewritten each call: cheap and
    deterministic)."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = make_problems(num_train, num_eval, max_value=max_value, seed=seed)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", held_out)
    train_tokenizer(out / "tokenizer", [f"{r['prompt']} {r['response']}" for r in train])
    logger.info("arithmetic task: %d train, %d eval problems in %s", len(train), len(held_out), out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/arithmetic")
    parser.add_argument("--num-train", type=int, default=20000)
    parser.add_argument("--num-eval", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from megatron_gkd.log_setup import setup_logging

    setup_logging("INFO")
    build_task(args.out, num_train=args.num_train, num_eval=args.num_eval, seed=args.seed)


if __name__ == "__main__":
    main()

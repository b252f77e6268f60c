"""The distillation demo's task: multi-digit addition with a short worked solution, generated from a seed.

A problem reads ``4 7 + 3 8 5 =`` (one token per digit) and its reference response writes the sum from
the units digit up, the order in which the carries flow, then the answer the usual way round after the
GSM8K-style marker ``####``::

    prompt    4 7 + 3 8 5 =
    response  2 3 4 #### 4 3 2

The worked part is what lets a two-layer model learn addition in minutes: every digit depends only on
two operand digits and the carry it has just written. The answer after ``####`` is checked exactly by
the ``final_answer`` scorer (:mod:`megatron_gkd.rewards.answers`). Train and eval problems are disjoint:
the eval set is drawn first and its pairs are excluded from the training draw.

The multi-teacher experiment's second task, ``add3``, is the sum of three numbers in the same format,
worked one operand at a time: the first running sum, ``=``, then the total, each from the units up::

    prompt    4 7 + 3 8 5 + 1 2 =
    response  2 3 4 = 4 4 4 #### 4 4 4

No new token, so both tasks share one tokenizer and the demo's models. The running sum is what makes it
learnable: written straight away, a digit of the total depends on three operand digits jointly and on
none of them alone (like a parity), and a 3-layer model trained from scratch sat on the plateau of a
model that reads no operand for 2,000 steps (loss 0.715 nats a token); worked, each digit is an
addition of two, the demo's task.

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

from megatron_gkd.log_setup import setup_logging

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
MARKER = "####"


def _spell(number: int) -> str:
    return " ".join(str(number))


def problem(*operands: int) -> dict:
    """The record of ``operands[0] + operands[1] + ...``: prompt, reference response (worked solution and
    answer) and answer. The worked solution adds one operand at a time, writing each running sum from
    the units up, separated by ``=``; with two operands it is the demo's."""
    running = [sum(operands[:count]) for count in range(2, len(operands) + 1)]
    worked = " = ".join(" ".join(reversed(str(partial))) for partial in running)
    return {"prompt": " + ".join(_spell(number) for number in operands) + " =",
            "response": f"{worked} {MARKER} {_spell(running[-1])}",
            "answer": str(running[-1])}


def make_problems(num_train: int, num_eval: int, *, max_value: int = 999, seed: int = 0,
                  num_operands: int = 2) -> tuple[list[dict], list[dict]]:
    """``num_train`` training and ``num_eval`` held-out sums of ``num_operands`` numbers over
    ``0..max_value``, deterministic in ``seed``; no operand tuple of the eval set appears in the training
    set. Two operands give the demo's problems (the same draw as before three were possible)."""
    rng = np.random.default_rng(seed)
    base = max_value + 1
    space = base ** num_operands
    if num_train + num_eval > space // 2:
        raise ValueError(f"{num_train + num_eval} problems asked from only {space} operand tuples; raise max_value")
    eval_tuples = rng.choice(space, size=num_eval, replace=False)
    held_out = set(eval_tuples.tolist())
    train_tuples = []
    while len(train_tuples) < num_train:
        for index in rng.integers(0, space, size=num_train).tolist():
            if index not in held_out and len(train_tuples) < num_train:
                train_tuples.append(index)

    def to_record(index: int) -> dict:
        operands = []
        for _ in range(num_operands):  # base-``base`` digits of the index, most significant first
            index, operand = divmod(int(index), base)
            operands.insert(0, operand)
        return problem(*operands)

    return [to_record(i) for i in train_tuples], [to_record(i) for i in eval_tuples]


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


# The multi-teacher experiment's tasks: name -> how its problems are drawn. ``add2`` is the demo's task
# (seed 0: the same train and eval problems as :func:`build_task`).
TASKS = {"add2": dict(num_operands=2, seed=0), "add3": dict(num_operands=3, seed=1)}


def build_multi_task(out: str | pathlib.Path, *, num_train: int = 20000, num_eval: int = 500,
                     max_value: int = 999) -> pathlib.Path:
    """The files of the multi-teacher experiment under ``out`` (rewritten each call):

    - ``<task>/train.jsonl``, ``<task>/eval.jsonl``: one task's problems (``num_train`` and ``num_eval``);
    - ``train.jsonl``, ``eval.jsonl``: every task's, interleaved, each record naming its ``task``;
    - ``tokenizer/``: the demo's (trained on the demo's problems as :func:`build_task` trains it: the
      trainer refuses a teacher and student whose tokenizers differ, and the demo's models are reused).
    """
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for task, draw in TASKS.items():
        train, held_out = make_problems(num_train, num_eval, max_value=max_value, **draw)
        splits[task] = [[{**record, "task": task} for record in records] for records in (train, held_out)]
        (out / task).mkdir(exist_ok=True)
        write_jsonl(out / task / "train.jsonl", splits[task][0])
        write_jsonl(out / task / "eval.jsonl", splits[task][1])
    for index, name in enumerate(("train.jsonl", "eval.jsonl")):
        # Interleaved, so a run's data order (shuffled or not) and a prefix of the eval set mix both tasks.
        write_jsonl(out / name, [record for group in zip(*(split[index] for split in splits.values())) for record in group])
    # The tokenizer's ids follow symbol frequencies: train it on the demo's own problems (build_task's
    # defaults), whatever sizes were asked here.
    demo_train, _ = make_problems(20000, 500)
    train_tokenizer(out / "tokenizer", [f"{r['prompt']} {r['response']}" for r in demo_train])
    logger.info("multi-task arithmetic: %s, %d train and %d eval problems each, in %s", ", ".join(TASKS), num_train,
                num_eval, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/arithmetic")
    parser.add_argument("--num-train", type=int, default=20000)
    parser.add_argument("--num-eval", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    setup_logging("INFO")
    build_task(args.out, num_train=args.num_train, num_eval=args.num_eval, seed=args.seed)


if __name__ == "__main__":
    main()

"""Responses sampled from a teacher, written as a dataset: what off-policy distillation trains on.

Off-policy SFT on teacher samples (``trainer.mode=sft``) and off-policy KD with the teacher's top-k
(``trainer.mode=off_policy``) read these records as they read reference responses. The teacher samples
with vLLM (the rollout engine the trainer uses), from the prompts as the trainer tokenizes them; a
response cut by ``max_tokens`` has no end and is left out (the count is logged)::

    python -m megatron_gkd.recipes.teacher_samples --teacher assets/demo/teacher \\
        --prompts outputs/demo_task/train.jsonl --out outputs/teacher_samples.jsonl --n 4

With ``--verify KIND`` a verifier keeps only the responses it accepts: the teacher writes, the reward (any
``reward.kind``, e.g. ``final_answer``, scored as ``eval.scorer`` scores) keeps those scoring at least
``--min-score``, and ``--keep`` caps what is kept of each prompt (the first accepted, in sample order). This is
rejection-sampling fine-tuning on the teacher's samples (RAFT, Dong et al. 2023; RFT, Yuan et al. 2023): the
recipe that took the demo's distilled student past its teacher (``configs/demo_verified_sft.yaml``,
docs/results.md "Do rewards pay?")::

    python -m megatron_gkd.recipes.teacher_samples --teacher assets/demo/teacher \\
        --prompts outputs/demo_task/train.jsonl --out outputs/demo_verified.jsonl --n 4 --verify final_answer --keep 1
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import pathlib
from collections.abc import Sequence

from megatron_gkd.config.schema import EvalConfig
from megatron_gkd.data import DataConfig, load_prompts, load_tokenizer
from megatron_gkd.data.tokenization import eos_token_id
from megatron_gkd.log_setup import setup_logging
from megatron_gkd.rewards.answers import final_answer
from megatron_gkd.rewards.kinds import REWARDS
from megatron_gkd.rollout import SamplingConfig, build_engine
from megatron_gkd.trainer.eval import Scorer, record_fields, response_text

logger = logging.getLogger(__name__)


def accepted(groups: Sequence[int], scores: Sequence[float], *, min_score: float, keep: int | None) -> list[bool]:
    """Which samples a verifier keeps: those scoring at least ``min_score``, at most ``keep`` of each group (prompt),
    the first in sample order (``keep`` None: every accepted one)."""
    taken: dict[int, int] = {}
    chosen = []
    for group, score in zip(groups, scores, strict=True):
        take = score >= min_score and (keep is None or taken.get(group, 0) < keep)
        taken[group] = taken.get(group, 0) + take
        chosen.append(take)
    return chosen


def sample_teacher(teacher: str | pathlib.Path, prompts_path: str | pathlib.Path, out: str | pathlib.Path, *,
                   n: int = 4, temperature: float = 1.0, max_tokens: int = 12, max_model_len: int = 64,
                   seed: int = 0, chunk: int = 2048, verify: str | None = None, min_score: float = 1.0,
                   keep: int | None = None) -> dict:
    """Samples ``n`` responses per prompt of ``prompts_path`` from ``teacher`` into the JSONL ``out`` (``prompt`` and
    ``response``, or, for a record of chat ``messages``, its messages with the response as the assistant's last;
    ``answer`` and ``group`` when the prompt record has them); returns counts.

    ``verify``: a reward kind (``reward.kind``'s names) that keeps only the responses scoring at least ``min_score``
    (the kind's default options; each prompt record must hold what the kind needs, e.g. an ``answer``); ``keep``:
    at most this many responses of each prompt, the first kept in sample order (None: all).

    One process, no ``torch.distributed``: vLLM keeps its engine in this process.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 responses a prompt (or None: every one kept)")
    tokenizer = load_tokenizer(str(teacher))
    dataset = load_prompts(str(prompts_path), DataConfig(train_path=str(prompts_path)), tokenizer)
    records = [dataset[i] for i in range(len(dataset))]
    texts = [json.loads(line) for line in pathlib.Path(prompts_path).read_text().splitlines() if line.strip()]
    eos = eos_token_id(tokenizer)
    scorer = None
    if verify is not None:
        scorer = Scorer(EvalConfig(scorer=verify), tokenizer, (eos,))
        missing = next((r for r in records if not scorer.scorable(record_fields(r))), None)
        if missing is not None:
            raise ValueError(f"verify={verify!r} reads {list(scorer.needs)} of every prompt record, and record "
                             f"{missing.index} of {prompts_path} has none: give each record its answer, or do not "
                             "verify")
    engine = build_engine("vllm", model=str(teacher), tensor_parallel_size=1, max_model_len=max_model_len,
                          seed=seed, pad_token_id=tokenizer.pad_token_id or 0)
    counts = {"prompts": len(records), "samples": 0, "ended": 0, "accepted": 0, "kept": 0, "prompts_kept": 0,
              "tokens": 0}
    try:
        with pathlib.Path(out).open("w") as handle:
            for begin in range(0, len(records), chunk):
                block = records[begin:begin + chunk]
                sampling = SamplingConfig(temperature=temperature, n=n, max_tokens=max_tokens, stop_token_ids=(eos,),
                                          seed=seed + begin)
                batch = engine.generate([list(r.prompt_ids) for r in block], sampling)
                counts["samples"] += batch.num_samples
                ended = [i for i in range(batch.num_samples) if batch.finish_reasons[i] == "stop"]
                counts["ended"] += len(ended)
                groups = [int(batch.group_ids[i]) for i in ended]
                scores = (scorer([batch.prompt(i) for i in ended], [batch.response(i) for i in ended],
                                 [record_fields(block[g]) for g in groups])
                          if scorer is not None else [math.inf] * len(ended))  # unverified: every ended one
                counts["accepted"] += sum(score >= min_score for score in scores)
                ended = [i for i, take in zip(ended, accepted(groups, scores, min_score=min_score, keep=keep)) if take]
                counts["prompts_kept"] += len({int(batch.group_ids[i]) for i in ended})
                for i in ended:
                    ids = batch.response(i)
                    source = texts[block[int(batch.group_ids[i])].index]
                    handle.write(json.dumps(_record(source, response_text(tokenizer, ids, (eos,)))) + "\n")
                    counts["kept"] += 1
                    counts["tokens"] += len(ids)
    finally:
        engine.close()
    logger.info("teacher samples: %d of %d kept (%d cut by max_tokens%s%s), %d of %d prompts with one, %d response "
                "tokens, in %s", counts["kept"], counts["samples"], counts["samples"] - counts["ended"],
                f", {counts['ended'] - counts['accepted']} refused by {verify}" if verify else "",
                f", {counts['accepted'] - counts['kept']} past --keep {keep}" if keep else "",
                counts["prompts_kept"], counts["prompts"], counts["tokens"], out)
    return counts


def _record(source: dict, response: str) -> dict:
    """The dataset record of ``response`` to the prompt record ``source``: a conversation's reference response is its
    last, assistant message; ``answer`` and ``group`` are kept."""
    if "messages" in source:
        record = {"messages": [*source["messages"], {"role": "assistant", "content": response}]}
    else:
        record = {"prompt": source["prompt"], "response": response}
    record.update({key: source[key] for key in ("answer", "group") if key in source})
    return record


def answer_accuracy(path: str | pathlib.Path, scorer=final_answer) -> float | None:
    """Share of the samples in ``path`` whose answer is right by ``scorer(response, answer)`` (default: the final
    answer after ``####``); None when the records carry no answers."""
    records = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
    scored = [r for r in records if "answer" in r]
    responses = [r["response"] if "response" in r else r["messages"][-1]["content"] for r in scored]
    return sum(scorer(text, r["answer"]) for text, r in zip(responses, scored)) / len(scored) if scored else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", required=True, help="the teacher's HF directory")
    parser.add_argument("--prompts", required=True, help="JSONL prompts (e.g. the arithmetic task's train.jsonl)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--max-model-len", type=int, default=64, help="prompt and response tokens, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify", choices=REWARDS.names(), help="keep only the responses this reward kind accepts "
                        "(e.g. final_answer; the prompt records need what it reads, e.g. an answer)")
    parser.add_argument("--min-score", type=float, default=1.0, help="--verify: the least score kept")
    parser.add_argument("--keep", type=int, help="at most this many responses of each prompt, the first kept")
    args = parser.parse_args(argv)

    setup_logging("INFO")
    sample_teacher(args.teacher, args.prompts, args.out, n=args.n, temperature=args.temperature,
                   max_tokens=args.max_tokens, max_model_len=args.max_model_len, seed=args.seed, verify=args.verify,
                   min_score=args.min_score, keep=args.keep)
    accuracy = answer_accuracy(args.out)
    if accuracy is not None:
        logger.info("teacher samples with the right final answer: %.3f", accuracy)


if __name__ == "__main__":
    main()

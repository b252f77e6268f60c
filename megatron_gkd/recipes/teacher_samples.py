"""Responses sampled from a teacher, written as a dataset: what off-policy distillation trains on.

Off-policy SFT on teacher samples (``trainer.mode=sft``) and off-policy KD with the teacher's top-k
(``trainer.mode=off_policy``) read these records as they read reference responses. The teacher samples
with vLLM (the rollout engine the trainer uses), from the prompts as the trainer tokenizes them; a
response cut by ``max_tokens`` has no end and is left out (the count is logged)::

    python -m megatron_gkd.recipes.teacher_samples --teacher assets/demo/teacher \\
        --prompts outputs/demo_task/train.jsonl --out outputs/teacher_samples.jsonl --n 4
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib

from megatron_gkd.data import DataConfig, load_prompts, load_tokenizer
from megatron_gkd.data.tokenization import eos_token_id
from megatron_gkd.log_setup import setup_logging
from megatron_gkd.rewards.answers import final_answer
from megatron_gkd.rollout import SamplingConfig, build_engine

logger = logging.getLogger(__name__)


def sample_teacher(teacher: str | pathlib.Path, prompts_path: str | pathlib.Path, out: str | pathlib.Path, *,
                   n: int = 4, temperature: float = 1.0, max_tokens: int = 12, max_model_len: int = 64,
                   seed: int = 0, chunk: int = 2048) -> dict:
    """Samples ``n`` responses per prompt of ``prompts_path`` from ``teacher`` into the JSONL ``out`` (``prompt`` and
    ``response``, or, for a record of chat ``messages``, its messages with the response as the assistant's last;
    ``answer`` and ``group`` when the prompt record has them); returns counts.

    One process, no ``torch.distributed``: vLLM keeps its engine in this process.
    """
    tokenizer = load_tokenizer(str(teacher))
    dataset = load_prompts(str(prompts_path), DataConfig(train_path=str(prompts_path)), tokenizer)
    records = [dataset[i] for i in range(len(dataset))]
    texts = [json.loads(line) for line in pathlib.Path(prompts_path).read_text().splitlines() if line.strip()]
    eos = eos_token_id(tokenizer)
    engine = build_engine("vllm", model=str(teacher), tensor_parallel_size=1, max_model_len=max_model_len,
                          seed=seed, pad_token_id=tokenizer.pad_token_id or 0)
    counts = {"prompts": len(records), "samples": 0, "kept": 0, "tokens": 0}
    try:
        with pathlib.Path(out).open("w") as handle:
            for begin in range(0, len(records), chunk):
                block = records[begin:begin + chunk]
                sampling = SamplingConfig(temperature=temperature, n=n, max_tokens=max_tokens, stop_token_ids=(eos,),
                                          seed=seed + begin)
                batch = engine.generate([list(r.prompt_ids) for r in block], sampling)
                for i in range(batch.num_samples):
                    counts["samples"] += 1
                    if batch.finish_reasons[i] != "stop":
                        continue
                    ids = batch.response(i)
                    source = texts[block[int(batch.group_ids[i])].index]
                    response = tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)
                    if "messages" in source:  # the reference response of a conversation is its last, assistant message
                        record = {"messages": [*source["messages"], {"role": "assistant", "content": response}]}
                    else:
                        record = {"prompt": source["prompt"], "response": response}
                    record.update({key: source[key] for key in ("answer", "group") if key in source})
                    handle.write(json.dumps(record) + "\n")
                    counts["kept"] += 1
                    counts["tokens"] += len(ids)
    finally:
        engine.close()
    logger.info("teacher samples: %d of %d kept (%d cut by max_tokens), %d response tokens, in %s", counts["kept"],
                counts["samples"], counts["samples"] - counts["kept"], counts["tokens"], out)
    return counts


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
    args = parser.parse_args(argv)

    setup_logging("INFO")
    sample_teacher(args.teacher, args.prompts, args.out, n=args.n, temperature=args.temperature,
                   max_tokens=args.max_tokens, max_model_len=args.max_model_len, seed=args.seed)
    accuracy = answer_accuracy(args.out)
    if accuracy is not None:
        logger.info("teacher samples with the right final answer: %.3f", accuracy)


if __name__ == "__main__":
    main()

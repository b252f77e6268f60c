"""A model's greedy answers to held-out prompts, scored as the trainer's eval scores the student's.

One process, no torch.distributed: vLLM at TP=1, temperature 0, the eval's scorer over the response's text. The
recipes and benchmarks that measure a model outside a training run (a teacher's accuracy, a pruned student's, the
student reading privileged context) share it.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from megatron_gkd.data import DataConfig, load_prompts, load_tokenizer
from megatron_gkd.data.tokenization import eos_token_id
from megatron_gkd.rollout import SamplingConfig, build_engine
from megatron_gkd.trainer.eval import response_text


def greedy_accuracy(model: str | pathlib.Path, eval_path: str | pathlib.Path, scorer: Callable[[str, str], float], *,
                    max_tokens: int, max_model_len: int = 64) -> tuple[float, list[str]]:
    """``model``'s greedy answers to the prompts of ``eval_path`` (``max_tokens`` each), scored by ``scorer(text,
    answer)``; returns the mean score and the answers' texts."""
    tokenizer = load_tokenizer(str(model))
    dataset = load_prompts(str(eval_path), DataConfig(eval_path=str(eval_path)), tokenizer)
    records = [dataset[i] for i in range(len(dataset))]
    eos = eos_token_id(tokenizer)
    engine = build_engine("vllm", model=str(model), tensor_parallel_size=1, max_model_len=max_model_len, seed=0,
                          pad_token_id=tokenizer.pad_token_id or 0)
    try:
        batch = engine.generate([list(r.prompt_ids) for r in records],
                                SamplingConfig(temperature=0.0, max_tokens=max_tokens, stop_token_ids=(eos,), seed=0))
    finally:
        engine.close()
    answers = [response_text(tokenizer, batch.response(i), (eos,)) for i in range(batch.num_samples)]
    return sum(scorer(text, record.answer) for text, record in zip(answers, records)) / len(records), answers

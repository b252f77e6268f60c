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


def sampled_scores(model: str | pathlib.Path, eval_path: str | pathlib.Path, scorer: Callable[[str, str], float], *,
                   max_tokens: int, max_model_len: int = 64, temperature: float = 0.0, n: int = 1,
                   seed: int = 0) -> tuple[list[list[float]], list[list[str]]]:
    """``n`` answers of ``model`` at ``temperature`` (0: greedy) to each prompt of ``eval_path`` (``max_tokens``
    each), scored by ``scorer(text, answer)``; returns each prompt's scores and texts, in the file's order."""
    tokenizer = load_tokenizer(str(model))
    dataset = load_prompts(str(eval_path), DataConfig(eval_path=str(eval_path)), tokenizer)
    records = [dataset[i] for i in range(len(dataset))]
    eos = eos_token_id(tokenizer)
    engine = build_engine("vllm", model=str(model), tensor_parallel_size=1, max_model_len=max_model_len, seed=seed,
                          pad_token_id=tokenizer.pad_token_id or 0)
    try:
        batch = engine.generate([list(r.prompt_ids) for r in records],
                                SamplingConfig(temperature=temperature, max_tokens=max_tokens, n=n,
                                               stop_token_ids=(eos,), seed=seed))
    finally:
        engine.close()
    texts = [[response_text(tokenizer, batch.response(i * n + j), (eos,)) for j in range(n)]
             for i in range(len(records))]
    return [[scorer(text, record.answer) for text in row] for row, record in zip(texts, records)], texts


def greedy_accuracy(model: str | pathlib.Path, eval_path: str | pathlib.Path, scorer: Callable[[str, str], float], *,
                    max_tokens: int, max_model_len: int = 64) -> tuple[float, list[str]]:
    """``model``'s greedy answers to the prompts of ``eval_path`` (``max_tokens`` each), scored by ``scorer(text,
    answer)``; returns the mean score and the answers' texts."""
    scores, texts = sampled_scores(model, eval_path, scorer, max_tokens=max_tokens, max_model_len=max_model_len)
    return sum(row[0] for row in scores) / len(scores), [row[0] for row in texts]

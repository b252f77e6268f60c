"""Rollout data contracts: :class:`SamplingConfig` in, :class:`RolloutBatch` out.

A batch holds ``num_samples = num_prompts * n`` rows; the ``n`` samples of prompt ``i`` are rows
``i*n .. i*n+n-1`` and share ``group_ids == i``. Token tensors are right-padded with ``pad_token_id``
and come with boolean masks, so a trainer can stack them without looking at lengths.

Rollout log-probs are the model's *raw* log-softmax (temperature 1, before top-p/top-k filtering) of
each sampled token, as vLLM's default ``logprobs_mode="raw_logprobs"`` reports them; the reference
engine computes the same quantity. ``topk_ids[i, t]`` are the ``k`` most likely ids of that raw
distribution at response position ``t`` (the ids TCAD asks the teacher to score).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np
import torch

from megatron_gkd.registry import Choice

logger = logging.getLogger(__name__)

class Layout(Choice):
    """Where the rollout engine runs (``rollout.layout``)."""

    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"

    @property
    def in_trainer(self) -> bool:
        """Every trainer rank holds (its shard of) the engine: rollout runs on the training ranks between updates
        and weights are loaded in-process."""
        return self is Layout.COLOCATED

    @property
    def sends_weights(self) -> bool:
        """A rollout server outside the trainers' world: weights are sent to it, and rollout overlaps training."""
        return self is Layout.DISAGGREGATED

    @property
    def transport(self) -> str:
        """The weight-sync transport an engine with weights of its own needs in this layout
        (``weight_sync.transport``)."""
        return "colocated" if self.in_trainer else "distributed"


@dataclasses.dataclass(kw_only=True)
class SamplingConfig:
    """How responses are sampled.

    Attributes:
        temperature: softmax temperature; ``0.0`` means greedy.
        top_p: nucleus mass in ``(0, 1]``; 1 disables it.
        top_k: keep the ``top_k`` most likely tokens; ``0`` (or ``-1``) disables it.
        max_tokens: most tokens generated per response.
        n: samples per prompt (one group).
        stop_token_ids: ids that end a response (kept in the response); the model's EOS always stops.
        seed: base seed; prompt ``i`` uses ``seed + i * n`` and its samples ``+ 0 .. n-1``, so a batch
            is reproducible and its samples differ. ``None``: not reproducible.
        logprobs_k: ids of the top-``k`` per response position to return (``0``: none).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = 0
    logprobs_k: int = 0

    def __post_init__(self):
        self.stop_token_ids = tuple(int(i) for i in self.stop_token_ids)
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p={self.top_p} must lie in (0, 1]; use 1.0 to disable it")
        if self.top_k < -1:
            raise ValueError(f"sampling.top_k={self.top_k} must be >= 0; use 0 to disable it")
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens={self.max_tokens} must be >= 1")
        if self.n < 1:
            raise ValueError(f"sampling.n={self.n} must be >= 1 (samples per prompt)")
        if self.logprobs_k < 0:
            raise ValueError(f"sampling.logprobs_k={self.logprobs_k} must be >= 0 (0: no top-k ids)")
        if any(i < 0 for i in self.stop_token_ids):
            raise ValueError(f"sampling.stop_token_ids={self.stop_token_ids} must be token ids >= 0")
        if self.greedy and (self.top_p < 1.0 or self.top_k):
            logger.warning("sampling.top_p/top_k have no effect with temperature=0 (greedy)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def prompt_seed(self, prompt_index: int) -> int | None:
        """Seed of prompt ``prompt_index`` (its ``n`` samples add 0 .. n-1)."""
        return None if self.seed is None else self.seed + prompt_index * self.n

    def to_vllm(self, prompt_index: int = 0, logit_bias: dict[int, float] | None = None):
        """``vllm.SamplingParams`` for prompt ``prompt_index`` (log-probs of the sampled tokens always;
        ``logit_bias``: added to those ids' logits before sampling)."""
        from vllm import SamplingParams

        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_tokens, stop_token_ids=list(self.stop_token_ids),
            seed=self.prompt_seed(prompt_index), logprobs=self.logprobs_k, flat_logprobs=True,
            detokenize=False, logit_bias=logit_bias)


@dataclasses.dataclass(kw_only=True)
class RolloutBatch:
    """Responses sampled for a batch of prompts (see the module docstring for the layout).

    Attributes:
        prompt_ids: ``[N, P]`` int64, right-padded.
        prompt_mask: ``[N, P]`` bool, True on real prompt tokens.
        response_ids: ``[N, R]`` int64, right-padded.
        response_mask: ``[N, R]`` bool, True on generated tokens.
        group_ids: ``[N]`` int64, index of the prompt each sample answers.
        rollout_logprobs: ``[N, R]`` float32 raw log-prob of each sampled token (0 on padding).
        weight_version: version of the weights that sampled the batch (with ``token_versions``: the oldest).
        finish_reasons: per sample, ``"stop"`` (EOS or a stop id) or ``"length"`` (max_tokens).
        topk_ids: ``[N, R, k]`` int64 top-k ids per response position, or None (padding: -1).
        token_versions: ``[N, R]`` int64 the weight version that sampled each response token (partial rollouts:
            a sample continued after a weight update holds tokens of several), or None: all ``weight_version``.
            Padding: -1.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor
    rollout_logprobs: torch.Tensor
    weight_version: int
    finish_reasons: list[str]
    topk_ids: torch.Tensor | None = None
    pad_token_id: int = 0
    token_versions: torch.Tensor | None = None

    def __post_init__(self):
        num = self.prompt_ids.shape[0]
        assert self.prompt_mask.shape == self.prompt_ids.shape, "prompt mask/ids shapes differ"
        assert self.response_mask.shape == self.response_ids.shape, "response mask/ids shapes differ"
        assert self.rollout_logprobs.shape == self.response_ids.shape, "log-probs/ids shapes differ"
        assert self.response_ids.shape[0] == num and self.group_ids.shape == (num,), "sample counts differ"
        assert len(self.finish_reasons) == num, "one finish reason per sample"
        assert self.topk_ids is None or self.topk_ids.shape[:2] == self.response_ids.shape
        assert self.token_versions is None or self.token_versions.shape == self.response_ids.shape

    @property
    def num_samples(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return self.prompt_mask.sum(dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(dim=1)

    @property
    def num_generated_tokens(self) -> int:
        return int(self.response_mask.sum())

    def prompt(self, i: int) -> list[int]:
        return self.prompt_ids[i, : int(self.prompt_lengths[i])].tolist()

    def response(self, i: int) -> list[int]:
        return self.response_ids[i, : int(self.response_lengths[i])].tolist()

    def logprobs(self, i: int) -> torch.Tensor:
        """``[T_i]`` rollout log-probs of sample ``i``'s response."""
        return self.rollout_logprobs[i, : int(self.response_lengths[i])]

    def topk(self, i: int) -> torch.Tensor | None:
        """``[T_i, k]`` top-k ids of sample ``i``, or None."""
        return None if self.topk_ids is None else self.topk_ids[i, : int(self.response_lengths[i])]

    def versions(self, i: int) -> torch.Tensor:
        """``[T_i]`` int64 the weight version that sampled each response token of sample ``i``."""
        length = int(self.response_lengths[i])
        if self.token_versions is None:
            return torch.full((length,), self.weight_version, dtype=torch.int64)
        return self.token_versions[i, :length]

    @classmethod
    def from_samples(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                     logprobs: Sequence[Sequence[float]], group_ids: Sequence[int], finish_reasons: list[str],
                     weight_version: int, topk: Sequence[Sequence[Sequence[int]]] | None = None,
                     pad_token_id: int = 0, versions: Sequence[Sequence[int]] | None = None) -> "RolloutBatch":
        """Pads per-sample lists into a batch (``prompts[i]`` is the prompt of sample ``i``; ``versions``: each
        response token's weight version, see ``token_versions``)."""
        prompt_ids, prompt_mask = _pad([list(p) for p in prompts], pad_token_id, torch.long)
        response_ids, response_mask = _pad([list(r) for r in responses], pad_token_id, torch.long)
        rollout_logprobs, _ = _pad([list(lp) for lp in logprobs], 0.0, torch.float32)
        topk_ids = None
        if topk is not None:
            k = max((len(row) for rows in topk for row in rows), default=0)
            topk_ids = torch.full((*response_ids.shape, k), -1, dtype=torch.long)
            for i, rows in enumerate(topk):
                if len(rows):
                    topk_ids[i, : len(rows)] = torch.as_tensor(rows, dtype=torch.long).reshape(len(rows), k)
        token_versions = None if versions is None else _pad([list(v) for v in versions], -1, torch.long)[0]
        return cls(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                   response_mask=response_mask, group_ids=torch.as_tensor(list(group_ids), dtype=torch.long),
                   rollout_logprobs=rollout_logprobs, weight_version=weight_version,
                   finish_reasons=list(finish_reasons), topk_ids=topk_ids, pad_token_id=pad_token_id,
                   token_versions=token_versions)


def _pad(rows: list[list], value, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(row) for row in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
        mask[i, : len(row)] = True
    return out, mask


def check_prompt_lengths(prompts: Sequence[Sequence[int]], sampling: SamplingConfig, max_model_len: int) -> None:
    """Rejects prompts that leave no room for ``max_tokens`` (never truncates them).

    Raises:
        ValueError: names how many prompts are too long and the two settings to change.
    """
    if not prompts:
        raise ValueError("no prompts given")
    empty = [i for i, prompt in enumerate(prompts) if len(prompt) == 0]
    if empty:
        raise ValueError(f"{len(empty)} empty prompts (indices {empty[:5]}); every prompt needs a token")
    limit = max_model_len - sampling.max_tokens
    too_long = [i for i, prompt in enumerate(prompts) if len(prompt) > limit]
    if too_long:
        longest = max(len(prompts[i]) for i in too_long)
        raise ValueError(
            f"{len(too_long)} of {len(prompts)} prompts are too long (longest {longest} tokens, indices "
            f"{too_long[:5]}): prompt + max_tokens={sampling.max_tokens} must fit max_model_len="
            f"{max_model_len}. Filter or shorten prompts in the dataset, lower sampling.max_tokens or "
            "raise max_model_len; prompts are never cut.")


_TENSOR_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "rollout_logprobs",
                  "topk_ids", "token_versions")
_DTYPES = {"int64": torch.int64, "bool": torch.bool, "float32": torch.float32}


def _encode_tensor(tensor: torch.Tensor | None):
    if tensor is None:
        return None
    array = tensor.detach().cpu().contiguous().numpy()
    return {"dtype": str(array.dtype), "shape": list(array.shape), "data": array.tobytes()}


def _decode_tensor(value) -> torch.Tensor | None:
    if value is None:
        return None
    if value["dtype"] not in _DTYPES:
        raise ValueError(f"rollout message carries a tensor of dtype {value['dtype']!r}")
    array = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    return torch.from_numpy(array.copy())


def encode_batch(batch: RolloutBatch) -> dict:
    """A msgpack-ready dict of ``batch`` (plain types and bytes: no pickle between processes)."""
    fields = {name: _encode_tensor(getattr(batch, name)) for name in _TENSOR_FIELDS}
    return {**fields, "weight_version": batch.weight_version, "finish_reasons": list(batch.finish_reasons),
            "pad_token_id": batch.pad_token_id}


def decode_batch(value: dict) -> RolloutBatch:
    """Inverse of :func:`encode_batch` (the batch's own checks run on the result)."""
    fields = {name: _decode_tensor(value.get(name)) for name in _TENSOR_FIELDS}
    return RolloutBatch(**fields, weight_version=int(value["weight_version"]),
                        finish_reasons=[str(r) for r in value["finish_reasons"]], pad_token_id=int(value["pad_token_id"]))


def concat_batches(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """One batch of ``batches`` in order (group ids renumbered after those before); the weight version
    must agree."""
    versions = {batch.weight_version for batch in batches}
    if len(versions) != 1:
        raise ValueError(f"cannot join rollout batches of different weight versions {sorted(versions)}")
    prompts, responses, logprobs, groups, reasons, topk = [], [], [], [], [], []
    offset = 0
    for batch in batches:
        for i in range(batch.num_samples):
            prompts.append(batch.prompt(i))
            responses.append(batch.response(i))
            logprobs.append(batch.logprobs(i).tolist())
            groups.append(int(batch.group_ids[i]) + offset)
            reasons.append(batch.finish_reasons[i])
            if batch.topk_ids is not None:
                topk.append(batch.topk(i).tolist())
        offset += int(batch.group_ids.max()) + 1 if batch.num_samples else 0
    has_topk = batches[0].topk_ids is not None
    return RolloutBatch.from_samples(prompts, responses, logprobs, groups, reasons, versions.pop(),
                                     topk=topk if has_topk else None, pad_token_id=batches[0].pad_token_id)

"""``megatron`` rollout engine: samples with the Megatron student itself (reference, no vLLM).

A plain loop without a KV cache: every step runs the whole (right-padded) batch of sequences through
the model and reads each sequence's logits at its last real token, which causal attention makes
independent of the padding after it. Slow (quadratic in length) but exact; it exists for tests and
for platforms without vLLM. The vocabulary shards are gathered over the TP group for sampling only,
so every TP rank draws the same tokens (same logits, same seeded generators). Token batches go to the
platform's device; the logits come back to the host, where the per-sample generators draw.

Pipeline parallelism is not supported here (``pipeline_model_parallel_size`` must be 1).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from megatron_gkd import platform
from megatron_gkd.models import parallel_state_of
from megatron_gkd.parallel import gather_tp
from megatron_gkd.rollout.engine import RolloutEngine
from megatron_gkd.rollout.types import RolloutBatch, SamplingConfig, check_prompt_lengths
from megatron_gkd.weight_sync.verify import student_prompt_logprobs

logger = logging.getLogger(__name__)


class MegatronEngine(RolloutEngine):
    """Samples with this rank's Megatron ``GPTModel`` chunks (all TP ranks call ``generate`` together).

    Args:
        chunks: the student's model chunks on this rank (one chunk: PP=1, no VPP).
        max_model_len: longest prompt + response.
        eos_token_id: id that ends a response (besides ``stop_token_ids``); None for none.
        vocab_size: real vocabulary size (logits beyond it, Megatron's padding, are never sampled).
        tp_group: tensor-parallel group the vocabulary is split over (default: that of the parallel state the
            chunks were built on).
        pad_token_id: padding id in the returned batch.
    """

    shares_student_weights = True

    def __init__(self, chunks, *, max_model_len: int, eos_token_id: int | None = None,
                 vocab_size: int | None = None, tp_group=None, pad_token_id: int = 0):
        state = parallel_state_of(chunks[0])
        if len(chunks) != 1 or state.pp_size != 1:
            raise ValueError("rollout engine 'megatron' needs pipeline_model_parallel_size=1 (one model "
                             "chunk); use rollout engine 'vllm' for pipelined students")
        self._model = chunks[0]
        self._device = platform.device()
        self._tp_group = tp_group if tp_group is not None else state.tp_group
        super().__init__(max_model_len)
        self._eos, self._vocab_size = eos_token_id, vocab_size
        self._pad_token_id = pad_token_id

    def load_weights(self, named_tensors, version: int) -> None:
        """The engine samples with the student's own parameters, which already hold the new weights:
        the stream is consumed (a receiver checks its buckets as they pass) and the version recorded."""
        for _ in named_tensors:
            pass
        self._weight_version = int(version)

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        return student_prompt_logprobs([self._model], prompts)

    @torch.no_grad()
    def _next_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """``[N, v]`` float32 raw logits after the last token of each sequence."""
        lengths = torch.tensor([len(s) for s in sequences])
        tokens = torch.full((len(sequences), int(lengths.max())), self._pad_token_id, dtype=torch.long)
        for i, sequence in enumerate(sequences):
            tokens[i, : len(sequence)] = torch.as_tensor(sequence)
        tokens = tokens.to(self._device)
        position_ids = torch.arange(tokens.shape[1], device=self._device).unsqueeze(0).expand_as(tokens)
        logits = self._model(tokens, position_ids, attention_mask=None)  # [N, s, v/tp]
        last = logits[torch.arange(len(sequences), device=logits.device), (lengths - 1).to(logits.device)]  # [N, v/tp]
        full = gather_tp(last.float().contiguous(), -1, self._tp_group).cpu()  # sampled on the host
        return full[:, : self._vocab_size] if self._vocab_size else full

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutBatch:
        check_prompt_lengths(prompts, sampling, self._max_model_len)
        self._model.eval()
        stop_ids = set(sampling.stop_token_ids) | ({self._eos} if self._eos is not None else set())
        prompt_rows = [list(map(int, p)) for p in prompts for _ in range(sampling.n)]
        group_ids = [i for i in range(len(prompts)) for _ in range(sampling.n)]
        generators = [_generator(sampling, i, j) for i in range(len(prompts)) for j in range(sampling.n)]
        responses = [[] for _ in prompt_rows]
        logprobs = [[] for _ in prompt_rows]
        topk = [[] for _ in prompt_rows]
        reasons: list[str | None] = [None] * len(prompt_rows)
        active = list(range(len(prompt_rows)))
        for _ in range(sampling.max_tokens):
            logits = self._next_logits([prompt_rows[i] + responses[i] for i in active])
            raw = torch.log_softmax(logits, dim=-1)  # the rollout log-probs: temperature 1, unfiltered
            for row, i in enumerate(active):
                token = _sample(logits[row], sampling, generators[i])
                responses[i].append(token)
                logprobs[i].append(float(raw[row, token]))
                if sampling.logprobs_k:
                    topk[i].append(torch.topk(raw[row], sampling.logprobs_k).indices.tolist())
                if token in stop_ids:
                    reasons[i] = "stop"
            active = [i for i in active if reasons[i] is None]
            if not active:
                break
        reasons = [reason or "length" for reason in reasons]
        return RolloutBatch.from_samples(
            prompts=prompt_rows, responses=responses, logprobs=logprobs, group_ids=group_ids,
            finish_reasons=reasons, weight_version=self._weight_version,
            topk=topk if sampling.logprobs_k else None, pad_token_id=self._pad_token_id)


def _generator(sampling: SamplingConfig, prompt_index: int, sample_index: int) -> torch.Generator:
    generator = torch.Generator()
    seed = sampling.prompt_seed(prompt_index)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed + sample_index)
    return generator


def _sample(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """One token from ``[v]`` logits: argmax when greedy, else temperature, top-k, top-p, multinomial."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    scaled = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= sampling.top_p
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))

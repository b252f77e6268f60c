"""``hf`` rollout engine: the student's HF checkpoint in ``transformers``, sampled over its KV cache.

For small models on the CPU. vLLM's CPU build spends about 7 ms of bookkeeping a decode step whatever the model's
size, which dominates a one-layer 128-wide student; a ``transformers`` forward of such a model over its KV cache
costs far less (TRL samples this way on the CPU). On large models, or on GPUs, vLLM's kernels and batching win:
use ``vllm``.

Colocated only, one whole model per rank (``rollout.tensor_parallel_size=1``): every rank is a replica and samples
its block of the prompts, seeded as one engine would seed them all (:class:`~megatron_gkd.trainer.rollout_handle.
Rollout`), as vLLM's replicas at TP=1 do. Weights arrive as the vLLM engine's do: weight sync streams HF-named
tensors into :meth:`HFEngine.load_weights`, which copies each into the model's parameter of that name in place.

With ``release_weights`` (``rollout.release_weights``, on by default for this engine) the engine keeps no copy of the
model: a load makes each parameter the tensor it is handed (the exporter's, a view of the student's own parameter
wherever Megatron's layout is HF's at TP=1: embeddings, output layer, norms, ``o_proj``, ``down_proj`` and the two
halves of ``linear_fc1``; a new tensor only for the fused QKV), and :meth:`HFEngine.release_weights`, called before the
trainer updates the student, drops them all. Between the release and the next sync the engine refuses to sample (it
would read weights half-way through an optimizer step); the next sync, which sends every weight, restores it.

Sampling is a loop over ``past_key_values``, not ``model.generate``: the sampling parameters are exactly the
:class:`~megatron_gkd.rollout.types.SamplingConfig` (``generate`` merges the checkpoint's ``generation_config``), each
sample draws from its own generator seeded as vLLM seeds its requests (``seed + i*n + j``,
:mod:`megatron_gkd.rollout.sampling`), and the raw log-probs come from the logits that sampled. Rows are
left-padded with an attention mask and explicit positions; a row that stops leaves the batch (its KV cache rows
with it), so the later decode steps cost only the rows still running.

Log-probs are raw (temperature 1, before top-k/top-p), as vLLM's ``logprobs_mode="raw_logprobs"``, over the
tokenizer's ids: rows of a padded embedding table past ``vocab_size`` are never sampled and carry no probability,
as in the trainer's own log-probs (vLLM's include them in the normaliser, with a -100 bias that keeps them from
being sampled).
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

import torch

from megatron_gkd import platform
from megatron_gkd.rollout.engine import RolloutEngine, StaleWeightsError
from megatron_gkd.rollout.sampling import draw_uniforms, sample_generators, sample_next
from megatron_gkd.rollout.types import RolloutBatch, SamplingConfig, check_prompt_lengths

logger = logging.getLogger(__name__)


class HFEngine(RolloutEngine):
    """Samples with ``AutoModelForCausalLM`` in this process, one whole model per rank.

    Args:
        model: HF checkpoint directory of the student (its initial weights and its EOS id, which always stops a
            response, as in vLLM).
        tensor_parallel_size: must be 1 (``rollout.tensor_parallel_size``): the engine is not split over ranks.
        max_model_len: longest prompt + response.
        dtype: weight dtype (``float32`` for exact comparisons on CPU).
        weight_version: version of the weights in ``model``.
        pad_token_id: padding id in the returned batches (and of the left padding, which is masked).
        vocab_size: the tokenizer's size, when the model's tables are longer: only ids below it are sampled.
        release_weights: keep no copy of the weights (module docstring): a load reads the tensors it is handed in
            place, whoever hands them calls :meth:`release_weights` before changing them.
        model_kwargs: further ``from_pretrained`` keyword arguments (``rollout.engine_args``, e.g.
            ``attn_implementation``).

    Raises:
        ValueError: ``tensor_parallel_size`` is not 1, ``vocab_size`` does not fit, or the model stores expert
            weights fused (weight sync sends them one expert at a time).
    """

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, max_model_len: int = 1024,
                 dtype: str = "float32", weight_version: int = 0, pad_token_id: int = 0,
                 vocab_size: int | None = None, release_weights: bool = False, **model_kwargs):
        if tensor_parallel_size != 1:
            raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel_size}: rollout engine 'hf' holds the "
                             "whole model on every rank (each rank is a replica that samples its share of the prompts); "
                             "set rollout.tensor_parallel_size=1, or use rollout.engine=vllm to split the model")
        from transformers import AutoModelForCausalLM

        super().__init__(max_model_len, weight_version)
        self._device = platform.device()
        self._model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), **model_kwargs)
        self._model.to(self._device).eval()
        self._model.requires_grad_(False)
        fused = [name for name, param in self._model.named_parameters() if param.dim() > 2 and ".experts." in name]
        if fused:
            raise ValueError(f"rollout engine 'hf' cannot take the weights of {model}: transformers stores its experts "
                             f"fused ({fused[0]}, ...), and weight sync sends them one expert at a time; use "
                             "rollout.engine=vllm for a mixture-of-experts student")
        # Every name a weight-sync stream may carry, tied aliases included (lm_head.weight is embed_tokens.weight).
        self._tensors = self._model.state_dict(keep_vars=True)
        self._shapes = {name: tuple(tensor.shape) for name, tensor in self._tensors.items()}  # a released one has none
        self.releases_weights = release_weights
        self._released = False
        rows = self._model.get_output_embeddings().weight.shape[0]
        if vocab_size is not None and not 0 < vocab_size <= rows:
            raise ValueError(f"the tokenizer's {vocab_size} ids do not fit the model's {rows}-row vocabulary")
        self._vocab_size = vocab_size or rows
        eos = self._model.generation_config.eos_token_id
        self._eos_ids = tuple(int(i) for i in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        self._pad_token_id = pad_token_id

    @torch.no_grad()  # not inference_mode: the batch's tensors go on into the trainer's autograd code
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutBatch:
        check_prompt_lengths(prompts, sampling, self._max_model_len)
        rows = [[int(t) for t in prompt] for prompt in prompts for _ in range(sampling.n)]
        uniforms = draw_uniforms(sample_generators(sampling, len(prompts)), sampling.max_tokens)  # [row, step]
        stops = torch.tensor(sorted(set(sampling.stop_token_ids) | set(self._eos_ids)), dtype=torch.long)
        num_rows, width, k = len(rows), max(len(row) for row in rows), sampling.logprobs_k
        input_ids = torch.full((num_rows, width), self._pad_token_id, dtype=torch.long)
        mask = torch.zeros(num_rows, width, dtype=torch.long)
        for i, row in enumerate(rows):  # left padding: every row's next token is the last column
            input_ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        mask, position = mask.to(self._device), positions[:, -1:].to(self._device)
        out = self._model(input_ids=input_ids.to(self._device), attention_mask=mask,
                          position_ids=positions.to(self._device), use_cache=True, logits_to_keep=1)
        tokens = torch.zeros(num_rows, sampling.max_tokens, dtype=torch.long)
        logprobs = torch.zeros(num_rows, sampling.max_tokens, dtype=torch.float32)
        topk = torch.zeros(num_rows, sampling.max_tokens, k, dtype=torch.long)
        lengths = torch.full((num_rows,), sampling.max_tokens)
        done = torch.zeros(num_rows, dtype=torch.bool)
        live = torch.arange(num_rows)  # the rows still decoding, in the order of the model's batch
        for step in range(sampling.max_tokens):
            logits = out.logits[:, -1, : self._vocab_size].float().cpu()  # [live, v]: sampled on the host
            raw = torch.log_softmax(logits, dim=-1)  # the rollout log-probs: temperature 1, unfiltered
            picked = sample_next(logits, uniforms[live, step], temperature=sampling.temperature, top_k=sampling.top_k,
                                 top_p=sampling.top_p)
            tokens[live, step] = picked
            logprobs[live, step] = raw.gather(1, picked[:, None])[:, 0]
            if k:
                topk[live, step] = torch.topk(raw, k, dim=-1).indices
            stopped = torch.isin(picked, stops)
            lengths[live[stopped]], done[live[stopped]] = step + 1, True
            if stopped.all() or step + 1 == sampling.max_tokens:
                break
            cache = out.past_key_values
            if stopped.any():  # a stopped row leaves the batch: its cache rows, mask row and position go
                keep = (~stopped).nonzero()[:, 0]
                live, picked = live[keep], picked[keep]
                keep = keep.to(self._device)
                cache.batch_select_indices(keep)
                mask, position = mask[keep], position[keep]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            position = position + 1
            out = self._model(input_ids=picked[:, None].to(self._device), attention_mask=mask, position_ids=position,
                              past_key_values=cache, use_cache=True)
        return RolloutBatch.from_samples(
            prompts=rows, responses=[tokens[i, : lengths[i]].tolist() for i in range(num_rows)],
            logprobs=[logprobs[i, : lengths[i]].tolist() for i in range(num_rows)],
            group_ids=[i // sampling.n for i in range(num_rows)],
            finish_reasons=["stop" if ended else "length" for ended in done.tolist()],
            weight_version=self._weight_version,
            topk=[topk[i, : lengths[i]].tolist() for i in range(num_rows)] if k else None,
            pad_token_id=self._pad_token_id)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copies HF-named tensors into the model's parameters in place (with ``release_weights``: takes each tensor of
        the parameter's dtype and device as the parameter itself, no copy) and sets the weight version.

        Args:
            named_tensors: ``(hf_name, full tensor)`` pairs, every weight of the model (consumed once); a tied
                output layer is its embedding (``lm_head.weight`` may come, or not, beside ``embed_tokens``).
            version: the version of the weights after this load (recorded in later batches).

        Raises:
            ValueError: a name the model does not have, a shape that differs, or a parameter that got no tensor (the
                engine is then stale: it would sample from a mix of two versions).
        """
        written: set[int] = set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = self._tensors.get(name)
                if target is None:
                    raise ValueError(f"rollout engine 'hf' got weight {name!r}, which its model does not have")
                if self._shapes[name] != tuple(tensor.shape):
                    raise ValueError(f"rollout engine 'hf' got weight {name!r} of shape {tuple(tensor.shape)}, its "
                                     f"model's is {self._shapes[name]}")
                if self.releases_weights:  # never written into: the parameter may be a view of the student's
                    target.data = tensor.to(dtype=target.dtype, device=target.device)  # the tensor itself if it can
                else:
                    target.copy_(tensor)
                written.add(id(target))
        # named_parameters() lists a tied parameter once: the alias written under either name counts.
        missing = [name for name, param in self._model.named_parameters() if id(param) not in written]
        if missing:
            raise ValueError(f"rollout engine 'hf' got no tensor for {len(missing)} of its weights ({missing[0]!r}, "
                             "...): a weight sync sends every weight")
        self._weight_version = int(version)
        self._released = False
        logger.debug("hf rollout engine now holds weight version %d", version)  # every step: DEBUG

    def release_weights(self) -> None:
        """Drops every weight (a parameter the trainer shares goes back to the trainer alone; a copy is freed) until
        the next complete :meth:`load_weights`; ``generate`` and :meth:`prompt_logprobs` refuse meanwhile."""
        if not self.releases_weights:
            raise RuntimeError("rollout engine 'hf' was built without release_weights: it holds its own copy of the "
                               "weights, which a release would lose")
        with torch.no_grad():
            for param in self._model.parameters():
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._released = True
        self.mark_stale(f"its weights (version {self._weight_version}) were released while the trainer updates them "
                        "(rollout.release_weights=true), and no weight sync has restored them yet")

    @torch.no_grad()
    def prompt_logprobs(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Over every row of the output layer, as vLLM's and the student's (what ``weight_sync.verify`` compares)."""
        if self._released:
            raise StaleWeightsError(f"rollout engine 'hf' cannot score prompts: {self.stale_reason}")
        values = []
        for prompt in prompts:
            tokens = torch.tensor([list(prompt)], device=self._device)
            logits = self._model(input_ids=tokens).logits[0, :-1]  # [s-1, v]
            logprobs = torch.log_softmax(logits.double(), dim=-1)
            values.append(logprobs.gather(-1, tokens[0, 1:, None])[:, 0].cpu())
        return torch.cat(values)

    def close(self) -> None:
        self._model = None
        self._tensors = {}

"""The student's update: micro-batches through Megatron's schedule with the loss on the last stage.

The loss of a micro-batch is ``sum(coefficient x per-token loss)`` (see :mod:`.batch`) of the terms its
:mod:`.specs` name, each computed from the student's logits as one source
(:mod:`megatron_gkd.losses.student_logits`: the ``[s, b, V/tp]`` shard without gathering the vocabulary, or, fused,
the hidden states and the output weight, so that the logits never exist). Megatron divides a micro-batch's loss by the number of
micro-batches and DDP averages gradients over data-parallel ranks; the loss handed back is scaled by both
so that the gradient is exactly that of the global batch's loss.
"""

from __future__ import annotations

import enum
import math
from functools import partial
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_gkd.losses.sampled_kl import mismatch_sums
from megatron_gkd.losses.student_logits import StudentLogits
from megatron_gkd.losses.terms import divergence_term, policy_gradient_term
from megatron_gkd.models import unwrap
from megatron_gkd.models.output_layer import capture_output_layer
from megatron_gkd.parallel import run_schedule
from megatron_gkd.trainer.batch import MicroBatch
from megatron_gkd.trainer.logit_capture import capture_logits, student_logits
from megatron_gkd.trainer.metrics import teacher_suffix
from megatron_gkd.trainer.specs import LossSpec, LossSpecs, PolicySpec, spec_for

# Statistics reduced by their maximum (MAX_STATS) or minimum (MIN_STATS) over micro-batches, ranks and the updates
# of one batch (the others are sums, averaged over a batch's epochs).
MAX_STATS = ("mismatch/max_ratio", "mismatch/max_inverse_ratio", "engine/max_abs", "token_staleness_max",
             "pg/ratio_max")
MIN_STATS = ("pg/ratio_min",)
# Statistics of the trainer against the rollout engine: valid at the weights the batch's first update starts from.
ENGINE_PREFIXES = ("mismatch/", "engine/")


class Pass(enum.Enum):
    """What a pass over a batch's micro-batches is for."""

    ONLY = "the batch's one update (or an evaluation): pi_old is the current policy, the ratio is 1"
    RECORD = "before several updates: no loss, records pi_old and the figures against the rollout engine"
    UPDATE = "one of several updates: the ratio against the recorded pi_old"


class StepRunner:
    """Runs micro-batches through this rank's chunks and steps the optimizer.

    Args:
        chunks: DDP-wrapped model chunks (one per virtual pipeline stage).
        optimizer, lr_scheduler: Megatron's optimizer and ``OptimizerParamScheduler``.
        tp_group: tensor-parallel group (the vocabulary split).
        dp_group: a gloo group over data-parallel ranks (statistics are summed over it).
        dp_size: data-parallel size (gradients are averaged over it by DDP).
        is_last_stage: whether this rank computes the loss.
        teacher_heads: ``{teacher name: [V/tp, h_t]}`` this rank's shards of the output layers of the teachers that
            send hidden states (``teacher`` for a single teacher).
        policy: the policy-gradient term of micro-batches that carry its inputs (``rl.combine``), or None.
        averages: the EMAs of the weights (:class:`~megatron_gkd.trainer.ema.WeightsEMA`) to update after every
            optimizer step.
    """

    def __init__(self, chunks, optimizer, lr_scheduler, *, tp_group, dp_group, dp_size: int, is_last_stage: bool,
                 teacher_heads: dict[str, torch.Tensor] | None = None, policy: PolicySpec | None = None,
                 averages: Sequence = ()):
        from megatron.core.distributed import finalize_model_grads

        self.chunks, self.optimizer, self.lr_scheduler = chunks, optimizer, lr_scheduler
        self.tp_group, self.dp_group, self.dp_size, self.is_last_stage = tp_group, dp_group, dp_size, is_last_stage
        self.teacher_heads = dict(teacher_heads or {})
        self.policy = policy
        self.averages = list(averages)
        for chunk in chunks:
            chunk.config.finalize_model_grads_func = finalize_model_grads
            if chunk.config.fp16:
                chunk.config.grad_scale_func = optimizer.scale_loss
        self._scale = 1.0
        self._pass = Pass.ONLY

    def train_step(self, spec: "LossSpecs", microbatches: Sequence[MicroBatch]) -> tuple[dict[str, float] | None, dict]:
        """The batch's optimizer steps (one, or ``rl.ppo_epochs x rl.mini_batches``: :meth:`_updates`); returns the loss
        statistics (last stage) and ``{grad_norm, lr}`` (the mean norm over the steps). The learning-rate schedule
        steps once per batch.

        Raises:
            RuntimeError: the optimizer skipped a step (non-finite gradients).
            ValueError: fewer micro-batches on this rank than ``rl.mini_batches``.
        """
        updates = self._updates(microbatches)
        several = len(updates) > 1
        recorded = None
        if several:
            with torch.no_grad():
                recorded = self.run(spec, microbatches, forward_only=True, purpose=Pass.RECORD)
        results, norms = [], []
        for group in updates:
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            results.append(self.run(spec, group, forward_only=False, purpose=Pass.UPDATE if several else Pass.ONLY,
                                    weight=self.policy.mini_batches if several else 1.0))
            update_successful, grad_norm, _ = self.optimizer.step()
            if not update_successful:
                raise RuntimeError("the optimizer skipped the step: the gradients are not finite (NaN/inf in the loss "
                                   "or the teacher rows); lower optim.lr or check the teacher's outputs")
            norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
            for average in self.averages:
                average.update()
        lr = self.optimizer.param_groups[0]["lr"]
        self.lr_scheduler.step(1)
        stats = self._merge(results, recorded) if several else results[0]
        return stats, {"grad_norm": sum(norms) / len(norms), "lr": float(lr)}

    def _updates(self, microbatches: Sequence[MicroBatch]) -> list[Sequence[MicroBatch]]:
        """The micro-batches of each optimizer step of the batch: all of them once, or ``rl.ppo_epochs`` passes of
        ``rl.mini_batches`` consecutive groups (sizes differing by one at most, the same cut on every rank that has
        as many micro-batches)."""
        if self.policy is None or self.policy.num_updates == 1:
            return [microbatches]
        count = self.policy.mini_batches
        if len(microbatches) < count:
            raise ValueError(f"rl.mini_batches={count} optimizer steps per pass, but this rank has "
                             f"{len(microbatches)} micro-batches: lower rl.mini_batches, or trainer.micro_batch_size "
                             "(or trainer.max_tokens_per_microbatch)")
        bounds = [len(microbatches) * index // count for index in range(count + 1)]
        groups = [microbatches[bounds[index]:bounds[index + 1]] for index in range(count)]
        return groups * self.policy.ppo_epochs

    def run(self, spec: "LossSpecs", microbatches: Sequence[MicroBatch], *, forward_only: bool,
            purpose: Pass = Pass.ONLY, weight: float = 1.0) -> dict[str, float] | None:
        """Forward (and backward) of ``microbatches``; the statistics summed over micro-batches and DP
        ranks on the last stage (``loss``: this step's loss; with several teachers also ``KEY/NAME`` per
        teacher), ``None`` elsewhere.

        Args:
            spec: a :class:`LossSpec` for every teacher, or ``{teacher name: LossSpec}``.
            purpose: what the pass is for (:class:`Pass`).
            weight: the gradient is that of ``weight x`` the loss (a mini-batch of ``rl.mini_batches``); the statistics
                are not scaled.
        """
        self._scale, self._pass = float(len(microbatches) * self.dp_size) * weight, purpose
        longest = max(mb.shape[1] for mb in microbatches)
        try:
            outputs = run_schedule(self.chunks, partial(self._forward_step, spec), list(microbatches),
                                   seq_length=longest, micro_batch_size=max(mb.shape[0] for mb in microbatches),
                                   forward_only=forward_only)
        finally:
            self._pass = Pass.ONLY
        if not self.is_last_stage:
            return None
        keys = sorted({key for stats in outputs for key in stats})  # the same on every DP rank
        summed = [k for k in keys if k not in MAX_STATS and k not in MIN_STATS]
        extreme = [k for k in keys if k in MAX_STATS or k in MIN_STATS]
        sign = torch.tensor([-1.0 if k in MIN_STATS else 1.0 for k in extreme], dtype=torch.float64)  # min = -max(-x)
        totals = torch.zeros(len(summed), dtype=torch.float64)
        maxima = torch.full((len(extreme),), -torch.inf, dtype=torch.float64)
        for stats in outputs:
            for index, key in enumerate(summed):
                if key in stats:
                    totals[index] += stats[key]
            for index, key in enumerate(extreme):
                if key in stats:
                    maxima[index] = torch.maximum(maxima[index], sign[index] * stats[key].double())
        if self.dp_size > 1:
            dist.all_reduce(totals, group=self.dp_group)
            if extreme:
                dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.dp_group)
        return {**{key: float(totals[index]) for index, key in enumerate(summed)},
                **{key: float(sign[index] * maxima[index]) for index, key in enumerate(extreme)}}

    def _merge(self, results: list, recorded: dict | None) -> dict | None:
        """The statistics of a batch's several updates (None off the last stage): sums averaged over the epochs (each
        epoch's mini-batches cover the batch once), extremes over every update, and the figures against the rollout
        engine from the pass that recorded ``pi_old``."""
        if recorded is None:
            return None
        merged: dict[str, float] = {}
        for stats in results:
            for key, value in stats.items():
                if key in MAX_STATS:
                    merged[key] = max(merged.get(key, -math.inf), value)
                elif key in MIN_STATS:
                    merged[key] = min(merged.get(key, math.inf), value)
                else:
                    merged[key] = merged.get(key, 0.0) + value / self.policy.ppo_epochs
        merged.update({key: value for key, value in recorded.items() if key.startswith(ENGINE_PREFIXES)})
        return merged
    def _forward_step(self, specs, data_iterator, model):
        microbatch: MicroBatch = next(data_iterator)
        device = next(model.parameters()).device
        tokens, position_ids = microbatch.tokens.to(device), microbatch.position_ids.to(device)
        spec = spec_for(specs)  # what the forward captures is the same for every teacher
        routing = self._routing_padding_mask(model, microbatch, device)
        if spec.kind.needs_labels:
            labels = microbatch.labels.to(device) if microbatch.labels is not None else None
            return (model(tokens, position_ids, attention_mask=None, labels=labels, **routing),
                    partial(self._loss, specs, microbatch, None))
        if spec.fused:
            with capture_output_layer(model, self.tp_group) as captured:
                output = model(tokens, position_ids, attention_mask=None, **routing)
            return output, partial(self._loss, specs, microbatch, captured)
        with capture_logits(model) as captured:
            output = model(tokens, position_ids, attention_mask=None, **routing)
        return output, partial(self._loss, specs, microbatch, captured)

    def _routing_padding_mask(self, model, microbatch: MicroBatch, device) -> dict:
        """``{"padding_mask": [b, s] or [b, s/tp]}`` for an MoE model (``{}`` otherwise): the router leaves padding
        out of its load-balancing loss, which then does not depend on how far a layout pads.

        ``GPTModel`` cuts the mask along the sequence for sequence parallelism on the first pipeline stage only;
        later stages get this rank's cut from here.
        """
        if not getattr(model.config, "num_moe_experts", None) or microbatch.padding_mask is None:
            return {}
        mask = microbatch.padding_mask.to(device)
        if model.config.sequence_parallel and not unwrap(model).pre_process:
            size, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
            width = mask.shape[1] // size
            mask = mask[:, rank * width : (rank + 1) * width]
        return {"padding_mask": mask}

    def _loss(self, specs, microbatch: MicroBatch, captured, output: torch.Tensor):
        device = output.device
        mask = microbatch.loss_mask.to(device)
        source = None if spec_for(specs).kind.needs_labels else student_logits(spec_for(specs), captured, output,
                                                                                self.tp_group)
        if self._pass is Pass.RECORD:
            return self._record_old_logprobs(spec_for(specs), microbatch, source, mask)
        stats: dict[str, torch.Tensor] = {"tokens": mask.sum().double()}
        if microbatch.token_versions is not None:
            stats.update(self._staleness_stats(microbatch, mask))
        sampled = None  # the policy gradient's token log-probs, when they came from the first teacher's pass
        if spec_for(specs).kind.needs_labels:
            per_token = torch.where(mask, output.float(), torch.zeros_like(output, dtype=torch.float32))
            contribution = (per_token * microbatch.coefficients.to(device=device, dtype=per_token.dtype)).sum()
        else:
            contribution = torch.zeros((), dtype=torch.float32, device=device)
            several = len(microbatch.teachers) > 1
            riding = self._tokens_riding_along(specs, microbatch)
            for share in microbatch.teachers:
                spec = spec_for(specs, share.name)
                tokens = microbatch.sampled.token_ids.to(device) if riding and sampled is None else None
                part, part_stats = divergence_term(spec, source, share.to(device), mask, token_ids=tokens,
                                                   head=self.teacher_heads.get(share.name))
                sampled = part_stats.pop("token_logprobs", sampled)
                self._source_stats(stats, microbatch, part_stats.pop("weighted"))
                contribution = contribution + part
                suffix = teacher_suffix(share.name, several)
                stats.update({f"{key}{suffix}": value for key, value in part_stats.items()})
                if several:
                    stats[f"tokens{suffix}"] = (mask & (share.coefficients.to(device) != 0)).sum().double()
            if several:
                stats["loss"] = contribution.detach().double()
        raw = sampled.detach() if sampled is not None and spec_for(specs).temperature == 1.0 else None
        if microbatch.policy is not None and self.policy is not None:
            stats["kd/loss"] = contribution.detach().double()
            part, part_stats = policy_gradient_term(self.policy, source, microbatch.policy.to(device),
                                                    microbatch.sampled.token_ids.to(device),
                                                    microbatch.sampled.logprobs.to(device), mask, sampled)
            policy_logprobs = part_stats.pop("token_logprobs")
            raw = policy_logprobs if self.policy.temperature == 1.0 else None
            contribution = contribution + part
            stats.update(part_stats)
            stats["loss"] = contribution.detach().double()
        if microbatch.sampled is not None and self._pass is Pass.ONLY:  # else the RECORD pass measured them
            stats.update(self._sampled_stats(spec_for(specs), microbatch, source, mask, raw))
        stats.setdefault("loss", contribution.detach().double())
        # Undo the schedule's division by the number of micro-batches and DDP's average over DP ranks.
        return contribution * self._scale, {key: value.detach().cpu() for key, value in stats.items()}

    def _record_old_logprobs(self, spec: LossSpec, microbatch: MicroBatch, source: StudentLogits, mask):
        """Before several updates of one batch: keeps the policy's log-probs of the sampled tokens as ``pi_old``
        (``microbatch.policy.old_logprobs``, ``[b, s]``) and measures the trainer against the rollout engine at the
        weights the batch was meant for (:meth:`_sampled_stats`); no loss."""
        policy = self.policy
        if microbatch.policy is None:  # nothing to record (the batch has no policy-gradient term)
            return torch.zeros((), dtype=torch.float32, device=mask.device), {}
        with torch.no_grad():
            logprobs = source.token_logprobs(microbatch.sampled.token_ids.to(mask.device), temperature=policy.temperature,
                                             real_vocab_size=policy.real_vocab_size).detach()
        microbatch.policy.old_logprobs = logprobs
        stats = self._sampled_stats(spec, microbatch, source, mask,
                                    logprobs if policy.temperature == 1.0 else None)
        return torch.zeros((), dtype=torch.float32, device=mask.device), {key: value.detach().cpu()
                                                                          for key, value in stats.items()}

    @staticmethod
    def _staleness_stats(microbatch: MicroBatch, mask: torch.Tensor) -> dict:
        """Partial rollouts: the staleness (``version - token_versions``) of the tokens the loss reads, summed over
        the loss mask, and its largest value among the tokens that carry a coefficient (a staleness bound,
        ``rollout.partial.max_staleness``, gives the others none)."""
        staleness = (microbatch.version - microbatch.token_versions.to(mask.device)).double()
        trained = mask & (microbatch.coefficients.to(mask.device) != 0)
        zero = torch.zeros_like(staleness)
        return {"token_staleness": torch.where(mask, staleness, zero).sum(),
                "token_staleness_max": torch.where(trained, staleness, zero).max()}

    @staticmethod
    def _source_stats(stats: dict, microbatch: MicroBatch, weighted: torch.Tensor) -> None:
        """GKD's mixture (``microbatch.sources``): each source's part of the loss (``mix/loss/<source>``, summed over
        teachers) and of the tokens' coefficients (``mix/weight/<source>``). ``weighted``: ``[b, s]`` the detached
        ``coefficient x divergence`` of one teacher."""
        for name, where in (microbatch.sources or {}).items():
            where = where.to(weighted.device)  # multiplied, not indexed: a boolean index is a host sync
            stats[f"mix/loss/{name}"] = stats.get(f"mix/loss/{name}", 0.0) + (weighted * where).sum().double()
            stats[f"mix/weight/{name}"] = (microbatch.coefficients.to(weighted.device) * where).sum().double()

    def _tokens_riding_along(self, specs, microbatch: MicroBatch) -> bool:
        """Whether the sampled tokens' log-probs come from the first teacher's divergence pass (one read of the logit
        shard, or one chunked recomputation of the fused logits, and one gradient write for both terms): top-k rows
        of the student's vocabulary, at the policy's temperature (the policy gradient reads them) or, without one,
        at temperature 1 (the engine check compares them with the engine's raw log-probs)."""
        if microbatch.sampled is None or not microbatch.teachers:
            return False
        spec = spec_for(specs, microbatch.teachers[0].name)
        if not spec.signal.sends_topk or spec.projection is not None:
            return False
        if self.policy is None or microbatch.policy is None:
            return spec.temperature == 1.0
        return spec.fused == self.policy.fused and spec.temperature == self.policy.temperature

    def _sampled_stats(self, spec: LossSpec, microbatch: MicroBatch, source: StudentLogits | None, mask, raw) -> dict:
        """The trainer's raw log-probs of the sampled tokens against the rollout engine's (:mod:`.engine_check`):
        sums over every sampled token (``mismatch/*``) and over those sampled with the weights being trained
        (``engine/*``). ``raw``: the trainer's, when a pass of the loss gave them at temperature 1; otherwise a no-grad
        pass computes them where the check is due or the policy gradient logs the mismatch every step."""
        sampled = microbatch.sampled
        if raw is None:
            if spec.kind.needs_labels or not (sampled.checked or microbatch.policy is not None):
                return {}
            with torch.no_grad():
                raw = source.token_logprobs(sampled.token_ids.to(mask.device), real_vocab_size=spec.real_vocab_size)
        engine = sampled.logprobs.to(mask.device)
        everything = mismatch_sums(raw, engine, mask & sampled.student.to(mask.device))
        current = mismatch_sums(raw, engine, mask & sampled.current.to(mask.device))
        return {"mismatch/k1": everything["k1"], "mismatch/k3": everything["k3"],
                "mismatch/max_ratio": everything["max_log_ratio"].exp(),
                "mismatch/max_inverse_ratio": everything["max_inverse_log_ratio"].exp(),
                "mismatch/tokens": everything["num_tokens"], "engine/abs": current["abs"],
                "engine/tokens": current["num_tokens"],
                "engine/max_abs": torch.maximum(current["max_log_ratio"], current["max_inverse_log_ratio"])}

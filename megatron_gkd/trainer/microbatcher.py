"""From a batch's samples and teacher rows to its micro-batches: each response token's share of the step's loss
(:mod:`.batch`, with TCAD's confidence weights), the policy-gradient inputs of this rank's share (:mod:`.policy`), the
cuts every rank of a pipeline (and of an expert-parallel group) agrees on, and the rows and coefficients of every
teacher that each micro-batch carries. :class:`~megatron_gkd.trainer.flow.BatchFlow` hands it a batch once the
teacher's rows and the rewards are in."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gkd.config import student_samples
from megatron_gkd.trainer import engine_check
from megatron_gkd.trainer.batch import (
    TeacherShare,
    build_microbatch,
    common_shape,
    plan_microbatches,
    split_to_count,
    token_coefficients,
)
from megatron_gkd.trainer.partial import token_staleness
from megatron_gkd.trainer.policy import policy_share, tp_rewards
from megatron_gkd.trainer.reward_exchange import REWARDS


class MicroBatcher:
    """Cuts a batch (a :class:`~megatron_gkd.trainer.flow.InFlight`) into micro-batches.

    Args:
        config: the run's config.
        state: the parallel state (this rank's stage, data-parallel size, TP group).
        teachers: the run's :class:`~megatron_gkd.trainer.teachers.Teachers` (names and mixture weights).
        dp_group: a gloo group over the data-parallel ranks.
        pad_id: the student's padding id.
    """

    def __init__(self, config, state, *, teachers, dp_group, pad_id: int):
        self.config, self.state, self.teachers, self.dp_group, self.pad_id = config, state, teachers, dp_group, pad_id
        self.loss_kind = config.trainer.run_mode.loss_kind
        self._engine_checked = False  # the first training batch of this process checks the engine

    def coefficients(self, batch, rows: dict, *, confidence: bool = True) -> tuple[list[torch.Tensor], dict]:
        """Each response token's share of the step's loss (see :mod:`.batch`), on the last stage (``confidence``:
        TCAD's confidence weights where ``loss.confidence_alpha`` asks for them), and the metrics of those weights
        (empty without them)."""
        samples, alpha = batch.samples, self.config.loss.confidence_alpha if confidence else None
        if not self.state.is_pipeline_last_stage:
            return [torch.zeros(s.response_len, dtype=torch.float64) for s in samples], {}
        total, groups = batch.rollout.num_generated_tokens, len(batch.prompt_indices)
        bound = self.config.rollout.partial.max_staleness if batch.partial is not None else None
        if bound is not None:  # partial rollouts: tokens staler than the bound train nothing; the mean is over the rest
            total = max(int((token_staleness(batch.rollout, batch.index) <= bound).sum()), 1)
        coefficients, metrics = self._coefficients(batch, rows, alpha, total, groups)
        if bound is not None:
            coefficients = [c * ((batch.index - s.versions) <= bound) for c, s in zip(coefficients, samples)]
        return coefficients, metrics

    def _coefficients(self, batch, rows: dict, alpha, total: int, groups: int):
        samples = batch.samples
        if alpha is None or not rows:
            return token_coefficients(samples, total_tokens=total, num_groups=groups), {}
        # Each sample's confidence comes from the one teacher that scores it (route; mixtures refuse alpha).
        token_logprobs: list = [None] * len(samples)
        for indices, teacher_rows_ in rows.values():
            for index, values in zip(indices, teacher_rows_.token_logprobs.split([samples[i].response_len
                                                                                  for i in indices])):
                token_logprobs[index] = values
        coefficients = token_coefficients(samples, total_tokens=total, num_groups=groups,
                                          teacher_token_logprobs=token_logprobs, confidence_alpha=alpha)
        return coefficients, self._confidence_weights(samples, coefficients, groups)

    def _confidence_weights(self, samples, coefficients, num_groups: int) -> dict:
        """Mean, max and entropy of TCAD's confidence weights per prompt group, over every DP rank."""
        groups: dict[int, list[float]] = {}
        for sample, coefficient in zip(samples, coefficients):
            groups.setdefault(sample.group, []).append(float(coefficient.sum()) * num_groups)
        totals = torch.zeros(3, dtype=torch.float64)  # sum of max weights, sum of entropies, groups
        for weights in groups.values():
            w = torch.tensor(weights, dtype=torch.float64)
            totals += torch.stack([w.max(), -(w * w.clamp_min(1e-30).log()).sum(), torch.tensor(1.0)])
        if self.state.data_parallel_size > 1:
            dist.all_reduce(totals, group=self.dp_group)
        count = max(float(totals[2]), 1.0)
        return {"train/confidence_weight_mean": 1.0 / self.config.rollout.n,
                "train/confidence_weight_max": float(totals[0]) / count,
                "train/confidence_weight_entropy": float(totals[1]) / count}

    def policy(self, batch, rows: dict):
        """The policy-gradient inputs of this rank's share (:mod:`.policy`) on the last stage; None elsewhere or
        without ``rl.combine``. Collective over the last stage's TP group when it trains on rewards."""
        rl = self.config.rl
        if not rl.enabled or not self.state.is_pipeline_last_stage:
            return None
        samples = batch.samples
        rewards = (tp_rewards(batch.annotations[REWARDS], len(samples), self.state.tp_group)
                   if rl.combination.uses_reward else None)
        weights = {teacher.name: teacher.weight for teacher in self.teachers}
        return policy_share(self.config, samples, rewards, rows, weights, num_tokens=batch.rollout.num_generated_tokens,
                            num_sequences=batch.rollout.num_samples, step=batch.index)


    def sampled(self, batch) -> tuple[int, bool] | None:
        """What :func:`~megatron_gkd.trainer.batch.build_microbatch` needs to place the sampled tokens (the engine
        check, the policy gradient): the version that sampled the batch and whether the check is due; None where no
        token was sampled by the student or this rank computes no loss."""
        if not (self.state.is_pipeline_last_stage and student_samples(self.config)):
            return None
        due = engine_check.check_due(self.config.weight_sync.check_interval, batch.index, first=not self._engine_checked)
        self._engine_checked = True
        return batch.rollout.weight_version, due

    def shares(self, samples, coefficients, rows: dict) -> list[TeacherShare]:
        """Every teacher's rows and token coefficients over all of ``samples`` (padding and 0 where it does not
        score a sample; its mixture weight times the token's share where it does)."""
        shares = []
        for teacher in self.teachers:
            if teacher.name not in rows:  # not the last stage
                continue
            indices, teacher_rows_ = rows[teacher.name]
            mine = dict(zip(indices, teacher_rows_.split([samples[i].response_len for i in indices])))
            shares.append(TeacherShare(
                teacher.name,
                [mine[i] if i in mine else teacher_rows_.padding(s.response_len) for i, s in enumerate(samples)],
                [coefficients[i] * teacher.weight if i in mine else torch.zeros_like(coefficients[i])
                 for i in range(len(samples))]))
        return shares

    def microbatches(self, samples, coefficients, rows: dict, *, labels: bool | None = None, policy=None,
                     sources=None, version: int | None = None, sampled: tuple[int, bool] | None = None) -> list:
        """The micro-batches of ``samples`` (every rank of a pipeline plans the same cuts; ``policy``: the
        policy-gradient inputs of ``samples``, a :class:`~megatron_gkd.trainer.batch.PolicyShare`; ``sources``: the
        mixture's source names, whose losses are measured apart; ``version``: the update's weight version, against
        which the loss measures the staleness of samples that record their tokens' versions; ``sampled``: the
        version that sampled them and whether the engine check is due, where the loss reads the sampled tokens)."""
        trainer, parallel = self.config.trainer, self.config.parallel
        plan = plan_microbatches([s.input_len for s in samples], micro_batch_size=trainer.micro_batch_size,
                                 max_tokens=trainer.max_tokens_per_microbatch)
        shares = self.shares(samples, coefficients, rows)
        multiple = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
        labels = self.loss_kind.needs_labels if labels is None else labels
        shapes = [common_shape(samples, [indices], multiple) for indices in plan]
        if parallel.expert_model_parallel_size > 1 and self.state.data_parallel_size > 1:
            plan, shapes = self._expert_parallel_cuts(samples, plan, multiple)
        if parallel.pipeline_model_parallel_size > 1:
            # Pipeline stages exchange activations of one shape per step (Megatron's variable_seq_lengths
            # refuses the allgather MoE dispatcher that the CPU needs): pad every micro-batch to it.
            shapes = [tuple(max(column) for column in zip(*shapes))] * len(plan)
        return [build_microbatch([samples[i] for i in indices], [coefficients[i] for i in indices], pad_multiple=multiple,
                                 teachers=[share.take(indices) for share in shares], labels=labels,
                                 pad_token_id=self.pad_id, shape=shape,
                                 policy=None if policy is None else policy.take(indices), sources=sources,
                                 version=version, sampled=sampled)
                for indices, shape in zip(plan, shapes)]

    def _expert_parallel_cuts(self, samples, plan, multiple: int) -> tuple[list, list]:
        """The cuts and ``(b, s)`` shapes that every data-parallel rank agrees on when experts are split over them.

        The token dispatcher gathers each micro-batch's tokens over the expert-parallel group, whose ranks hold
        other data-parallel shares: every rank must run as many micro-batches, the k-th of the same shape.
        Dynamic batching halves micro-batches of ranks that planned fewer; padding is masked out of the loss
        and of the routing statistics (``MicroBatch.padding_mask``).
        """
        count = torch.tensor([len(plan)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.dp_group)
        plan = split_to_count(plan, int(count))
        shapes = torch.tensor([common_shape(samples, [indices], multiple) for indices in plan])
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=self.dp_group)
        return plan, [tuple(shape) for shape in shapes.tolist()]

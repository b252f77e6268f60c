"""From a step's prompts to its micro-batches: sampling (through the run's
:class:`~megatron_gkd.trainer.rollout_handle.Rollout`), the batch's annotators (:mod:`.annotations`: the teacher's
rows through :class:`~megatron_gkd.trainer.teacher_exchange.TeacherExchange`, the rewards, any other) and the
micro-batcher (each token's loss coefficient, the cuts every rank agrees on, the teacher rows each micro-batch
carries).

A batch is an :class:`InFlight`: ``produce`` makes its samples and sends them to its annotators (the teacher records
which teacher scores each one, once, and asks the remote ones); ``prepare`` waits for it, receives every annotation
(a colocated teacher is asked then) and returns :class:`Prepared` (the micro-batches and what the loop logs of them).

Every rank runs the same calls in the same order (they are collectives on the control group, the TP
group or the rollout server's group); a failure on one rank (a teacher past its deadline) stops every
rank at the same point (:func:`megatron_gkd.parallel.comm.agree`).
"""

from __future__ import annotations

import dataclasses
import logging

import torch.distributed as dist

from megatron_gkd.config.partial import partial_rollouts
from megatron_gkd.data.tokenization import pad_id
from megatron_gkd.rollout.sources import dataset_batch
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.trainer.annotations import Annotations, Annotator
from megatron_gkd.trainer.batch import rank_samples, share_rows
from megatron_gkd.trainer.components import build_reward_runner
from megatron_gkd.trainer.dynamic_sampling import round_seed, sample_informative
from megatron_gkd.trainer.eval import record_fields
from megatron_gkd.trainer.microbatcher import MicroBatcher
from megatron_gkd.trainer.partial import PartialRollout, groups_batch, staleness_metrics
from megatron_gkd.trainer.reward_exchange import REWARDS, RewardExchange, RewardsFailed
from megatron_gkd.trainer.sample_mix import STUDENT, Mixture, merge_by_prompt
from megatron_gkd.trainer.teacher_exchange import Asked, TeacherExchange
from megatron_gkd.trainer.teachers import Teachers

logger = logging.getLogger(__name__)

PARTIAL_STATE_KEY = "partial"
"""Where a checkpoint's data position keeps partial rollouts' buffer (beside the sampler's state)."""


def batch_seed(config, index: int) -> int | None:
    """The sampling seed of batch ``index`` (``rollout.seed`` moved on per batch), or None without one."""
    seed = config.rollout.seed
    return None if seed is None else seed + index * 1_000_003


@dataclasses.dataclass
class InFlight:
    """A batch on its way to the update that trains it (see :mod:`.schedulers`).

    Attributes:
        index: the batch (= step) index.
        data_state: the sampler's state before this batch's prompts were drawn (resuming re-samples it).
        prompt_indices: dataset rows of the batch's prompts, in group order.
        rollout: the sampled batch (all samples of all data-parallel ranks).
        samples: this rank's data-parallel share.
        pending: disaggregated rollout: the future of ``(rollout, samples, sent)`` from the rollout thread.
        sent: each annotator's handle by name (:mod:`.annotations`): ``teacher``'s an
            :class:`~megatron_gkd.trainer.teacher_exchange.Asked` (which teacher scores each sample, recorded when the
            samples are made, and the requests sent); ``rewards``' the future of this rank's rewards on the ranks that
            compute them, else None.
        annotations: each annotator's value by name once :meth:`BatchFlow.prepare` has them (``teacher``: a
            :class:`~megatron_gkd.trainer.teacher_exchange.Scored`, the rows; ``rewards``: this rank's, one per
            sample, or None).
        sources: each prompt's source (``student``, ``dataset`` or ``teacher``) with ``sample_mix``, else None.
        answers: each prompt's answer (None where it has none) with ``sample_mix``, else None.
        partial: partial rollouts' ``rollout/partial/*`` metrics of the step that sampled it, else None.
        dynamic: ``rl/dynamic_*`` metrics of the rounds that made it (``rl.dynamic_sampling``), else None.
        failure: the error of a round's rewards (``rl.dynamic_sampling``; raised on every rank), kept for the update:
            the trainer saves the last complete step with this batch's data position, as for a reward that fails there.
    """

    index: int
    data_state: dict
    prompt_indices: list[int]
    rollout: RolloutBatch | None
    samples: list | None
    pending: object = None
    sent: dict = dataclasses.field(default_factory=dict)
    annotations: dict = dataclasses.field(default_factory=dict)
    sources: list[str] | None = None
    answers: list[str | None] | None = None
    partial: dict | None = None
    dynamic: dict | None = None
    failure: BaseException | None = None

    def resolve(self) -> None:
        """Waits for a rollout still running on the rollout server (a no-op otherwise); raises the failure a batch
        kept for its update."""
        if self.failure is not None:
            raise self.failure
        if self.pending is not None:
            self.rollout, self.samples, self.sent = self.pending.result()
            self.pending = None


@dataclasses.dataclass
class Prepared:
    """What :meth:`BatchFlow.prepare` hands the update.

    Attributes:
        microbatches: the batch's micro-batches (:class:`~megatron_gkd.trainer.batch.MicroBatch`), in order.
        confidence: TCAD's confidence-weight metrics of the batch (``train/confidence_weight_*``) where
            ``loss.confidence_alpha`` weighs its tokens, else empty.
        metrics: the teachers' (:meth:`TeacherExchange.metrics`), the annotators' (the rewards'), the rollout
            server's and the mixture's metrics of the batch, the same on every rank (empty when ``scoring``).
    """

    microbatches: list
    confidence: dict = dataclasses.field(default_factory=dict)
    metrics: dict = dataclasses.field(default_factory=dict)


class BatchFlow:
    """Samples batches and turns them, with their annotations (the teacher's rows through its
    :class:`TeacherExchange`, ``exchange``; the rewards, ``rewards``), into micro-batches.

    Args:
        config: the run's config.
        state: the parallel state.
        control: a gloo group over every rank.
        dp_group: a gloo group over the data-parallel ranks.
        tokenizer: the student's tokenizer (vocabulary size, EOS, padding).
        timers: the trainer's phase timers.
        teachers: the run's :class:`~megatron_gkd.trainer.teachers.Teachers` (the trainer connects their clients
            and loads their heads).
        rollout: the run's :class:`~megatron_gkd.trainer.rollout_handle.Rollout` (None when nothing is sampled).
        stop_ids: ids that end a response (stripped before its reward is computed).
        annotators: annotators of each batch's samples besides the teacher and the rewards (:mod:`.annotations`), in
            order.
    """

    def __init__(self, config, state, *, control, dp_group, tokenizer, timers, teachers: Teachers, rollout=None,
                 stop_ids=(), annotators: tuple[Annotator, ...] = ()):
        self.config, self.state, self.control, self.timers, self.rollout = config, state, control, timers, rollout
        self.pad_id = pad_id(tokenizer)
        self.rank = dist.get_rank()
        self.teachers = teachers
        self.batcher = MicroBatcher(config, state, teachers=teachers, dp_group=dp_group, pad_id=self.pad_id)
        self.exchange = TeacherExchange(config, state, control=control, tokenizer=tokenizer, timers=timers,
                                        teachers=teachers)
        # Rewards are computed where the teacher is asked, each rank's for its share; their worker starts now.
        self.rewards = RewardExchange(enabled=config.reward.enabled, control=control, timers=timers,
                                      runner=build_reward_runner(config, asks=self.exchange.is_teacher_rank),
                                      tokenizer=tokenizer, stop_token_ids=stop_ids)
        self.annotations = Annotations([self.exchange, self.rewards, *annotators])
        self.mix = None  # GKD's mixture (sample_mix), or None
        if config.sample_mix.enabled:
            self.mix = Mixture(config, state, control=control, teachers=teachers, asks_teacher=self.exchange.is_teacher_rank,
                               tokenizer=tokenizer, stop_ids=stop_ids, timers=timers, pad_id=self.pad_id)
        self.partial = None  # trainer.scheduler=partial: the buffer of unfinished samples and its driver
        if partial_rollouts(config):
            self.partial = PartialRollout(config, rollout, prompts_per_step=config.trainer.global_batch_size // config.rollout.n,
                                          pad_id=self.pad_id)

    # -------------------------------------------------------------------------------------- sampling
    def produce_batch(self, index: int, draw, data_state: dict, version: int) -> InFlight:
        """Batch ``index`` from the prompts ``draw(count)`` returns (``count=None``: one step's): partial rollouts
        draw as many as their buffer has room for, round by round; ``rl.dynamic_sampling`` draws until the batch holds
        a step's groups whose rewards differ; otherwise :meth:`produce` one step's."""
        if self.partial is None and self.config.rl.enabled and self.config.rl.dynamic_sampling:
            return self._produce_informative(index, draw, data_state)
        if self.partial is None:
            return self.produce(index, draw(), data_state, version)
        with self.timers("rollout"):
            groups, metrics = self.partial.sample(index, draw, version, batch_seed(self.config, index))
        records = [group.record for group in groups]
        return self._send(index, data_state, records, groups_batch(groups, self.pad_id), partial=metrics)

    def produce(self, index: int, records, data_state: dict, version: int) -> InFlight:
        """Samples (or reads, or asks the teacher for) the responses of ``records`` and sends this rank's teacher
        request (and its rewards' request)."""
        config = self.config
        prompt_indices = [record.index for record in records]
        prompt_groups = [record.group for record in records]
        sources = None if self.mix is None else self.mix.sources(index, len(records))
        answers = None if sources is None else [record.answer for record in records]
        if config.trainer.run_mode.samples:
            student = [i for i in range(len(records)) if sources is None or sources[i] == STUDENT]
            parts = [] if sources is None else self.mix.off_policy_parts(records, sources, version, batch_seed(self.config, index))
            prompts, sampling = [list(records[i].prompt_ids) for i in student], config.rollout.sampling(batch_seed(self.config, index))

            def merged(batch: RolloutBatch) -> RolloutBatch:  # the student's samples among the off-policy ones
                if sources is None:
                    return batch
                return merge_by_prompt(parts + [(student, batch)], batch.weight_version, self.pad_id)

            if not student:
                rollout = merge_by_prompt(parts, version, self.pad_id)
            elif self.rollout.in_background:  # sampled on the rollout server while this rank trains
                fields = {record.index: record_fields(record) for record in records}
                pending = self.rollout.generate_then(prompts, sampling, lambda batch: self._background_share(
                    merged(batch), index, prompt_indices, prompt_groups, fields, sources))
                return InFlight(index, data_state, prompt_indices, None, None, pending=pending, sources=sources,
                                answers=answers)
            else:
                with self.timers("rollout"):
                    rollout = merged(self.rollout.generate(prompts, sampling))
        else:
            rollout = dataset_batch(records, version, self.pad_id)
        return self._send(index, data_state, records, rollout, sources, answers)

    def _produce_informative(self, index: int, draw, data_state: dict) -> InFlight:
        """``rl.dynamic_sampling``: batch ``index`` of prompt groups whose rewards differ, drawn and sampled round by
        round (:mod:`.dynamic_sampling`; collective over every rank each round: the rollout and the rewards)."""
        rl = self.config.rl

        def sample(records, round_index: int) -> tuple[RolloutBatch, list[float]]:
            sampling = self.config.rollout.sampling(round_seed(batch_seed(self.config, index), round_index))
            with self.timers("rollout"):
                rollout = self.rollout.generate([list(record.prompt_ids) for record in records], sampling)
            return rollout, self.rewards.everyone(rollout, records, self.state)

        try:
            made = sample_informative(draw, sample, num_prompts=self.config.trainer.global_batch_size // self.config.rollout.n,
                                      max_rounds=rl.dynamic_sampling_max_rounds, pad_id=self.pad_id)
        except RewardsFailed as failed:  # every rank has it (RewardExchange.receive agrees): the update raises it
            return InFlight(index, data_state, [], None, None, failure=failed.error)
        short = int(made.metrics["rl/dynamic_groups_short"])
        if short and self.rank == 0:
            logger.warning("batch %d: %d of its %d prompt groups have rewards that differ after %d sampling rounds; %d "
                           "groups of equal rewards (no reward advantage) fill the rest: raise "
                           "rl.dynamic_sampling_max_rounds, or use prompts the student solves some of the time", index,
                           len(made.records) - short, len(made.records), int(made.metrics["rl/dynamic_rounds"]), short)
        return self._send(index, data_state, made.records, made.rollout, rewards=made.rewards, dynamic=made.metrics)

    def _send(self, index: int, data_state: dict, records, rollout: RolloutBatch, sources=None, answers=None,
              partial=None, rewards: list[float] | None = None, dynamic: dict | None = None) -> InFlight:
        """This rank's share of ``rollout``, its teachers' requests and its rewards' (sent now, answered meanwhile;
        ``rewards``: every sample's, already known)."""
        prompt_indices = [record.index for record in records]
        fields = {record.index: record_fields(record) for record in records}
        samples = rank_samples(rollout, self.state, prompt_indices, [record.group for record in records], sources)
        known = None
        if rewards is not None:  # already known (dynamic sampling): this rank's share of them
            rows = share_rows(rollout, len(records), self.state.data_parallel_size, self.state.dp_rank)
            known = {REWARDS: self.rewards.known([rewards[row] for row in rows])}
        # the teacher's requests, the rewards' (decoded here, computed in their worker), any other annotator's
        sent = self.annotations.send(samples, fields, known, index=index)
        return InFlight(index, data_state, prompt_indices, rollout, samples, sent=sent, sources=sources,
                        answers=answers, partial=partial, dynamic=dynamic)

    def _background_share(self, rollout, index, prompt_indices, prompt_groups, fields, sources=None):
        """On the rollout thread: the server's batch and this rank's annotators' requests for its share (a colocated
        Megatron teacher is a collective of the training ranks: it is asked in the update)."""
        samples = rank_samples(rollout, self.state, prompt_indices, prompt_groups, sources)
        return rollout, samples, self.annotations.send(samples, fields, index=index, background=True)

    # -------------------------------------------------------------------------------- micro-batches
    def prepare(self, batch: InFlight, *, scoring: bool = False) -> Prepared:
        """Waits for the batch and its teacher rows, and cuts it into micro-batches.

        ``scoring``: the micro-batches that score the batch against every teacher whatever the mode (eval's KL):
        the teachers' own top-k (no TCAD support), no confidence weights, no labels.
        """
        with self.timers("rollout_wait"):
            batch.resolve()
        samples, metrics = batch.samples, {}
        if scoring:  # eval: the teachers alone, asked now
            scored = self.exchange.receive(batch.sent[self.exchange.name], scoring=True)
        else:  # the teacher's rows, then the rewards (computed meanwhile) and any other annotation
            batch.annotations = self.annotations.receive(batch.sent)
            scored = batch.annotations[self.exchange.name]
            metrics = {**self.annotations.metrics(batch.annotations, samples or []), **self._metrics(batch)}
        rows = scored.rows
        sources = (STUDENT, self.mix.source) if self.mix is not None and not scoring else None
        with self.timers("batch"):
            coefficients, confidence = self.batcher.coefficients(batch, rows, confidence=not scoring)
            policy = None if scoring else self.batcher.policy(batch, rows)
            if policy is not None and not self.config.rl.combination.uses_divergence:
                rows = {}  # the teacher is in the advantage only: no divergence term
            elif policy is not None:  # rl.combine=loss: the divergence weighs rl.kd_coef beside the policy gradient
                coefficients = [c * policy.kd_coef for c in coefficients]
            microbatches = self.batcher.microbatches(samples, coefficients, rows, labels=False if scoring else None,
                                             policy=policy, sources=sources, version=None if scoring else batch.index,
                                             sampled=None if scoring else self.batcher.sampled(batch))
        return Prepared(microbatches, confidence, metrics)

    def _metrics(self, batch: InFlight) -> dict:
        """The rollout server's, the teacher weight's, dynamic sampling's, partial rollouts' and the mixture's metrics
        of a batch about to be trained (beside the teachers' and the annotators'; collective over every rank)."""
        metrics = {}
        if self.rollout is not None and self.rollout.in_background:  # the rollout server's restarts
            metrics.update(self.rollout.metrics())
        rl = self.config.rl
        if rl.enabled and rl.kd_coef_end is not None:  # the teacher's weight on its schedule
            metrics["rl/kd_coef"] = rl.kd_coef_at(batch.index)
        if batch.dynamic is not None:  # from the global batch's rewards, the same on every rank
            metrics.update(batch.dynamic)
        if batch.partial is not None:  # from the global batch, the same on every rank
            metrics.update({**batch.partial, **staleness_metrics(batch.rollout, batch.index,
                                                                 self.config.rollout.partial.max_staleness)})
        if batch.sources is not None:  # from the global batch, the same on every rank
            metrics.update(self.mix.metrics(batch.rollout, batch.index, batch.sources, batch.answers))
        return metrics

    def scoring_batch(self, rollout: RolloutBatch, prompt_indices: list[int], prompt_groups: list) -> InFlight:
        """``rollout`` (sampled elsewhere, e.g. eval answers) as a batch for :meth:`prepare` with ``scoring``."""
        samples = rank_samples(rollout, self.state, prompt_indices, prompt_groups)
        return InFlight(-1, {}, prompt_indices, rollout, samples,
                        sent={self.exchange.name: Asked(-1, samples, self.exchange.assign(samples))})

    # ------------------------------------------------------------------------------- the data position
    def data_state(self, sampler_state: dict) -> dict:
        """The data position a checkpoint saves: the sampler's, with partial rollouts' buffer."""
        return sampler_state if self.partial is None else {**sampler_state, PARTIAL_STATE_KEY: self.partial.state_dict()}

    def restore(self, data_state: dict) -> dict:
        """Reads back what :meth:`data_state` added (the buffer) and returns the sampler's state."""
        if self.partial is not None and PARTIAL_STATE_KEY in data_state:
            self.partial.load_state_dict(data_state[PARTIAL_STATE_KEY])
        return {key: value for key, value in data_state.items() if key != PARTIAL_STATE_KEY}

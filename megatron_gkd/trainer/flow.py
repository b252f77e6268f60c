"""From a step's prompts to its micro-batches: sampling (through the run's
:class:`~megatron_gkd.trainer.rollout_handle.Rollout`), the hand-off to the teacher exchange
(:class:`~megatron_gkd.trainer.teacher_exchange.TeacherExchange`: requests, outputs, rows) and the micro-batcher (each
token's loss coefficient, the cuts every rank agrees on, the teacher rows each micro-batch carries).

A batch is an :class:`InFlight`: ``produce`` makes its samples, records which teacher scores each one (once) and
sends the remote teachers' requests; ``prepare`` waits for it, asks a colocated teacher, gets the rows and returns
:class:`Prepared` (the micro-batches and what the loop logs of them).

Every rank runs the same calls in the same order (they are collectives on the control group, the TP
group or the rollout server's group); a failure on one rank (a teacher past its deadline) stops every
rank at the same point (:func:`megatron_gkd.parallel.comm.agree`).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.distributed as dist

from megatron_gkd.config import needs_teacher, student_samples
from megatron_gkd.config.checks import generating_teacher
from megatron_gkd.config.partial import partial_rollouts
from megatron_gkd.data.tokenization import pad_id
from megatron_gkd.parallel.comm import agree, broadcast_msgpack
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.teacher import GenerateBatch
from megatron_gkd.trainer import engine_check
from megatron_gkd.trainer.batch import (
    TeacherShare,
    build_microbatch,
    common_shape,
    plan_microbatches,
    samples_from_rollout,
    split_to_count,
    token_coefficients,
)
from megatron_gkd.trainer.components import build_reward_runner
from megatron_gkd.trainer.dynamic_sampling import round_seed, sample_informative
from megatron_gkd.trainer.eval import Scorer, record_fields
from megatron_gkd.trainer.partial import PartialRollout, groups_batch, staleness_metrics, token_staleness
from megatron_gkd.trainer.policy import policy_share, tp_rewards
from megatron_gkd.trainer.reward_exchange import RewardExchange
from megatron_gkd.trainer.sample_mix import (
    STUDENT,
    dataset_batch,
    draw_sources,
    generated_batch,
    merge_by_prompt,
    sample_scores,
    source_metrics,
)
from megatron_gkd.trainer.teacher_exchange import TeacherExchange, TeacherFailed
from megatron_gkd.trainer.teachers import Teachers

logger = logging.getLogger(__name__)

PARTIAL_STATE_KEY = "partial"
"""Where a checkpoint's data position keeps partial rollouts' buffer (beside the sampler's state)."""


class _RewardsFailed(Exception):
    """A round's rewards failed on some rank (``error``: this rank's :meth:`RewardExchange.receive` error)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


@dataclasses.dataclass
class InFlight:
    """A batch on its way to the update that trains it (see :mod:`.schedulers`).

    Attributes:
        index: the batch (= step) index.
        data_state: the sampler's state before this batch's prompts were drawn (resuming re-samples it).
        prompt_indices: dataset rows of the batch's prompts, in group order.
        rollout: the sampled batch (all samples of all data-parallel ranks).
        samples: this rank's data-parallel share.
        assignment: the indices in ``samples`` that each teacher scores ``{teacher name: [index]}``, recorded when the
            samples are made (:meth:`TeacherExchange.assign`); every later use reads it.
        teacher: this rank's requests ``{teacher name: Request}`` (ranks that ask a teacher), or None.
        pending: disaggregated rollout: the future of ``(rollout, samples, assignment, teacher, reward)`` from the
            rollout thread.
        reward: the future of this rank's rewards (:mod:`.reward_exchange`; ranks that compute them), or None.
        rewards: this rank's rewards, one per sample, once :meth:`BatchFlow.prepare` has them, or None.
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
    assignment: dict[str, list[int]] | None = None
    teacher: object = None
    pending: object = None
    reward: object = None
    rewards: list[float] | None = None
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
            self.rollout, self.samples, self.assignment, self.teacher, self.reward = self.pending.result()
            self.pending = None


@dataclasses.dataclass
class Prepared:
    """What :meth:`BatchFlow.prepare` hands the update.

    Attributes:
        microbatches: the batch's micro-batches (:class:`~megatron_gkd.trainer.batch.MicroBatch`), in order.
        confidence: TCAD's confidence-weight metrics of the batch (``train/confidence_weight_*``) where
            ``loss.confidence_alpha`` weighs its tokens, else empty.
    """

    microbatches: list
    confidence: dict = dataclasses.field(default_factory=dict)


class BatchFlow:
    """Samples batches and turns them, with the teacher's rows (through its :class:`TeacherExchange`, ``exchange``),
    into micro-batches.

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
    """

    def __init__(self, config, state, *, control, dp_group, tokenizer, timers, teachers: Teachers, rollout=None,
                 stop_ids=()):
        self.config, self.state, self.control, self.dp_group = config, state, control, dp_group
        self.tokenizer, self.timers, self.rollout, self.stop_ids = tokenizer, timers, rollout, tuple(stop_ids)
        self.loss_kind = config.trainer.run_mode.loss_kind
        self.pad_id = pad_id(tokenizer)
        self.rank = dist.get_rank()
        self.teachers = teachers
        self.exchange = TeacherExchange(config, state, control=control, tokenizer=tokenizer, timers=timers,
                                        teachers=teachers)
        # Rewards are computed where the teacher is asked, each rank's for its share; their worker starts now.
        self.rewards = RewardExchange(enabled=config.reward.enabled, control=control, timers=timers,
                                      runner=build_reward_runner(config, asks=self.exchange.is_teacher_rank),
                                      tokenizer=tokenizer, stop_token_ids=stop_ids)
        self.mix = config.sample_mix
        # mix/accuracy/<source> scores answers as the eval does; looked up once, for a run with a mixture only
        self._scorer = Scorer(config.eval, tokenizer, stop_ids) if self.mix.enabled else None
        self.generator = generating_teacher(config)  # the teacher that writes responses (sample_mix), or None
        if self.generator is not None:
            # One rank asks for every teacher-written response of a batch (the teacher rank of the first data-parallel
            # share): the responses then do not depend on the layout. Collective over every rank.
            asker = torch.tensor([self.rank if self.exchange.is_teacher_rank and state.dp_rank == 0 else -1])
            dist.all_reduce(asker, op=dist.ReduceOp.MAX, group=control)
            self._generator_rank = int(asker)
        self._engine_checked = False  # the first training batch of this process checks the engine
        self.partial = None  # trainer.scheduler=partial: the buffer of unfinished samples and its driver
        if partial_rollouts(config):
            self.partial = PartialRollout(config, rollout, prompts_per_step=config.trainer.global_batch_size // config.rollout.n,
                                          pad_id=self.pad_id)

    @property
    def tcad(self) -> dict:
        """TCAD's support per teacher name (None where it does not apply): the exchange's, for the start-up checks."""
        return self.exchange.tcad

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
            groups, metrics = self.partial.sample(index, draw, version, self._seed(index))
        records = [group.record for group in groups]
        return self._send(index, data_state, records, groups_batch(groups, self.pad_id), partial=metrics)

    def data_state(self, sampler_state: dict) -> dict:
        """The data position a checkpoint saves: the sampler's, with partial rollouts' buffer."""
        return sampler_state if self.partial is None else {**sampler_state, PARTIAL_STATE_KEY: self.partial.state_dict()}

    def restore(self, data_state: dict) -> dict:
        """Reads back what :meth:`data_state` added (the buffer) and returns the sampler's state."""
        if self.partial is not None and PARTIAL_STATE_KEY in data_state:
            self.partial.load_state_dict(data_state[PARTIAL_STATE_KEY])
        return {key: value for key, value in data_state.items() if key != PARTIAL_STATE_KEY}

    def produce(self, index: int, records, data_state: dict, version: int) -> InFlight:
        """Samples (or reads, or asks the teacher for) the responses of ``records`` and sends this rank's teacher
        request (and its rewards' request)."""
        config = self.config
        prompt_indices = [record.index for record in records]
        prompt_groups = [record.group for record in records]
        fields = {record.index: record_fields(record) for record in records}
        sources = self.sources(index, len(records))
        answers = None if sources is None else [record.answer for record in records]
        if config.trainer.run_mode.samples:
            student = [i for i in range(len(records)) if sources is None or sources[i] == STUDENT]
            parts = self._off_policy_parts(index, records, sources, version)
            prompts, sampling = [list(records[i].prompt_ids) for i in student], config.rollout.sampling(self._seed(index))

            def merged(batch: RolloutBatch) -> RolloutBatch:  # the student's samples among the off-policy ones
                if sources is None:
                    return batch
                return merge_by_prompt(parts + [(student, batch)], batch.weight_version, self.pad_id)

            if not student:
                rollout = merge_by_prompt(parts, version, self.pad_id)
            elif self.rollout.in_background:  # sampled on the rollout server while this rank trains
                pending = self.rollout.generate_then(prompts, sampling, lambda batch: self._background_share(
                    merged(batch), prompt_indices, prompt_groups, fields, sources))
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
            sampling = self.config.rollout.sampling(round_seed(self._seed(index), round_index))
            with self.timers("rollout"):
                rollout = self.rollout.generate([list(record.prompt_ids) for record in records], sampling)
            return rollout, self._batch_rewards(rollout, records)

        try:
            made = sample_informative(draw, sample, num_prompts=self.config.trainer.global_batch_size // self.config.rollout.n,
                                      max_rounds=rl.dynamic_sampling_max_rounds, pad_id=self.pad_id)
        except _RewardsFailed as failed:  # every rank has it (RewardExchange.receive agrees): the update raises it
            return InFlight(index, data_state, [], None, None, failure=failed.error)
        short = int(made.metrics["rl/dynamic_groups_short"])
        if short and self.rank == 0:
            logger.warning("batch %d: %d of its %d prompt groups have rewards that differ after %d sampling rounds; %d "
                           "groups of equal rewards (no reward advantage) fill the rest: raise "
                           "rl.dynamic_sampling_max_rounds, or use prompts the student solves some of the time", index,
                           len(made.records) - short, len(made.records), int(made.metrics["rl/dynamic_rounds"]), short)
        return self._send(index, data_state, made.records, made.rollout, rewards=made.rewards, dynamic=made.metrics)

    def _batch_rewards(self, rollout: RolloutBatch, records) -> list[float]:
        """Every sample's reward of ``rollout`` on every rank (each share's computed by its reward worker, waited for)."""
        prompt_indices = [record.index for record in records]
        samples = self.my_samples(rollout, prompt_indices, [record.group for record in records])
        future = self.rewards.send(samples, {record.index: record_fields(record) for record in records})
        try:
            values = self.rewards.receive(future)
        except Exception as error:  # noqa: BLE001 - raised on every rank alike (receive agrees); kept for the update
            raise _RewardsFailed(error) from error
        rows = [self.share_rows(rollout, len(records), share) for share in range(self.state.data_parallel_size)]
        return self.rewards.gather(values, rows, self.state.dp_rank)

    def _send(self, index: int, data_state: dict, records, rollout: RolloutBatch, sources=None, answers=None,
              partial=None, rewards: list[float] | None = None, dynamic: dict | None = None) -> InFlight:
        """This rank's share of ``rollout``, its teachers' requests and its rewards' (sent now, answered meanwhile;
        ``rewards``: every sample's, already known)."""
        prompt_indices = [record.index for record in records]
        fields = {record.index: record_fields(record) for record in records}
        samples = self.my_samples(rollout, prompt_indices, [record.group for record in records], sources)
        assignment = self.exchange.assign(samples)
        teacher = None
        if needs_teacher(self.config):
            with self.timers("teacher_send"):
                teacher = self.exchange.request(samples, assignment)
        if rewards is None:
            reward = self.rewards.send(samples, fields)  # decoded here, computed in the reward worker meanwhile
        else:
            reward = self.rewards.known([rewards[row] for row in self.share_rows(rollout, len(records))])
        return InFlight(index, data_state, prompt_indices, rollout, samples, assignment, teacher, reward=reward,
                        sources=sources, answers=answers, partial=partial, dynamic=dynamic)

    def _background_share(self, rollout, prompt_indices, prompt_groups, fields, sources=None):
        """On the rollout thread: the server's batch and this rank's teacher and reward requests for its share (a
        colocated Megatron teacher is a collective of the training ranks: it is asked in the update)."""
        samples = self.my_samples(rollout, prompt_indices, prompt_groups, sources)
        assignment = self.exchange.assign(samples)
        teacher = self.exchange.request(samples, assignment, local=False) if needs_teacher(self.config) else None
        return rollout, samples, assignment, teacher, self.rewards.send(samples, fields)

    # ------------------------------------------------------------------------------- GKD's mixture
    def sources(self, index: int, num_prompts: int) -> list[str] | None:
        """Each prompt's source in batch ``index`` (``sample_mix``; the same on every rank), or None without one."""
        if not self.mix.enabled:
            return None
        seed = self.mix.seed if self.mix.seed is not None else self.config.trainer.seed
        return draw_sources(self.mix, seed=seed, step=index, num_prompts=num_prompts)

    def _off_policy_parts(self, index: int, records, sources: list[str] | None, version: int) -> list:
        """``(positions, batch)`` of the prompts whose responses are not the student's: the records' own, or the
        teacher's (asked now; collective over every rank when the batch has any)."""
        off = [i for i in range(len(records)) if sources is not None and sources[i] != STUDENT]
        if not off:
            return []
        chosen = [records[i] for i in off]
        if self.mix.source.from_records:
            return [(off, dataset_batch(chosen, version, self.pad_id))]
        prompts = [list(record.prompt_ids) for record in chosen]
        with self.timers("teacher_generate"):
            responses = self.teacher_responses(index, prompts)
        return [(off, generated_batch(prompts, responses, self.config.rollout.n, self.stop_ids, version, self.pad_id))]

    def teacher_responses(self, index: int, prompts: list[list[int]]) -> list[list[int]]:
        """The teacher's ``rollout.n`` responses to each of ``prompts`` (prompt by prompt), with its own sampling
        settings (``sample_mix.teacher.*``), seeded per batch like the rollout. One rank asks, every rank gets them;
        every rank stops if the request failed. Collective over every rank."""
        settings, responses, error = self.mix.teacher, None, None
        if self.rank == self._generator_rank:
            try:
                batch = GenerateBatch(prompts=[np.asarray(p, dtype=np.int64) for p in prompts],
                                      num_samples=self.config.rollout.n, temperature=settings.temperature,
                                      top_p=settings.top_p, top_k=settings.top_k,
                                      max_tokens=settings.max_tokens or self.config.rollout.max_tokens,
                                      stop_ids=self.stop_ids, seed=self._seed(index))
                client = self.teachers.by_name[self.generator].client
                responses = [sample.response_ids.tolist() for sample in client.generate(batch)]
            except Exception as caught:  # noqa: BLE001 - shared with every rank below
                error = caught if not self.teachers.several else TeacherFailed(self.generator, caught)
        agree(error, self.control)
        return broadcast_msgpack(responses, self._generator_rank, self.control)

    def _seed(self, index: int) -> int | None:
        seed = self.config.rollout.seed
        return None if seed is None else seed + index * 1_000_003

    def share_rows(self, rollout: RolloutBatch, num_prompts: int, share: int | None = None) -> list[int]:
        """The rows of ``rollout`` in data-parallel share ``share`` (default this rank's): a contiguous block of whole
        prompt groups."""
        groups = np.array_split(np.arange(num_prompts), self.state.data_parallel_size)
        mine = set(groups[self.state.dp_rank if share is None else share].tolist())
        return [i for i in range(rollout.num_samples) if int(rollout.group_ids[i]) in mine]

    def my_samples(self, rollout: RolloutBatch, prompt_indices: list[int], prompt_groups: list | None = None,
                   sources: list[str] | None = None) -> list:
        """This data-parallel rank's samples: a contiguous block of whole prompt groups."""
        rows = self.share_rows(rollout, len(prompt_indices))
        return samples_from_rollout(rollout, rows, prompt_indices, prompt_groups, sources)

    def annotation_metrics(self, batch: InFlight) -> dict:
        """The teachers', the rewards', the rollout server's and the mixture's metrics of a trained batch (collective over every rank)."""
        metrics = {**self.exchange.metrics(batch.teacher, batch.samples),
                   **self.rewards.metrics(batch.rewards, [sample.group for sample in batch.samples or []])}
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
            metrics.update(source_metrics(batch.rollout, batch.sources, self.mix.source, self.mix.lmbda_at(batch.index),
                                          sample_scores(batch.rollout, batch.answers, self._score)))
        return metrics

    def _score(self, prompt: list[int], response: list[int], answer: str) -> float:
        """One response's score against its prompt's answer with ``eval.scorer``, as the eval reads an answer."""
        return self._scorer([prompt], [response], [{"answer": answer}])[0]

    # -------------------------------------------------------------------------------- micro-batches
    def prepare(self, batch: InFlight, *, scoring: bool = False) -> Prepared:
        """Waits for the batch and its teacher rows, and cuts it into micro-batches.

        ``scoring``: the micro-batches that score the batch against every teacher whatever the mode (eval's KL):
        the teachers' own top-k (no TCAD support), no confidence weights, no labels.
        """
        with self.timers("rollout_wait"):
            batch.resolve()
        exchange, samples, assignment = self.exchange, batch.samples, batch.assignment
        if scoring or needs_teacher(self.config):
            asked = batch.teacher if batch.teacher is not None else {}
            # A colocated Megatron teacher is a collective of the training ranks: it is asked here, in the update.
            asked.update(exchange.request(samples, assignment, local=None if scoring else True, skip=asked,
                                          tcad=not scoring))
            batch.teacher = asked
        outputs = exchange.outputs(batch.teacher)
        if not scoring:  # computed meanwhile; waited for after the teacher's rows (a no-op without rewards)
            batch.rewards = self.rewards.receive(batch.reward)
        with self.timers("batch"):
            distills = scoring or self.loss_kind.needs_teacher
            rows = exchange.rows(samples, assignment, outputs, tcad=not scoring) if distills else {}
            exchange.check_heads(batch.index, samples, rows, scoring=scoring)
            coefficients, confidence = self.coefficients(batch, rows, confidence=not scoring)
            policy = None if scoring else self.policy(batch, rows)
            if policy is not None and not self.config.rl.combination.uses_divergence:
                rows = {}  # the teacher is in the advantage only: no divergence term
            elif policy is not None:  # rl.combine=loss: the divergence weighs rl.kd_coef beside the policy gradient
                coefficients = [c * policy.kd_coef for c in coefficients]
            sources = (STUDENT, self.mix.source) if self.mix.enabled and not scoring else None
            microbatches = self.microbatches(samples, coefficients, rows, labels=False if scoring else None,
                                             policy=policy, sources=sources, version=None if scoring else batch.index,
                                             sampled=None if scoring else self._sampled(batch))
        return Prepared(microbatches, confidence)

    def _sampled(self, batch: InFlight) -> tuple[int, bool] | None:
        """What :func:`~megatron_gkd.trainer.batch.build_microbatch` needs to place the sampled tokens (the engine
        check, the policy gradient): the version that sampled the batch and whether the check is due; None where no
        token was sampled by the student or this rank computes no loss."""
        if not (self.state.is_pipeline_last_stage and student_samples(self.config)):
            return None
        due = engine_check.check_due(self.config.weight_sync.check_interval, batch.index, first=not self._engine_checked)
        self._engine_checked = True
        return batch.rollout.weight_version, due

    def policy(self, batch: InFlight, rows: dict):
        """The policy-gradient inputs of this rank's share (:mod:`.policy`) on the last stage; None elsewhere or
        without ``rl.combine``. Collective over the last stage's TP group when it trains on rewards."""
        rl = self.config.rl
        if not rl.enabled or not self.state.is_pipeline_last_stage:
            return None
        samples = batch.samples
        rewards = tp_rewards(batch.rewards, len(samples), self.state.tp_group) if rl.combination.uses_reward else None
        weights = {teacher.name: teacher.weight for teacher in self.teachers}
        return policy_share(self.config, samples, rewards, rows, weights, num_tokens=batch.rollout.num_generated_tokens,
                            num_sequences=batch.rollout.num_samples, step=batch.index)

    def scoring_batch(self, rollout: RolloutBatch, prompt_indices: list[int], prompt_groups: list) -> InFlight:
        """``rollout`` (sampled elsewhere, e.g. eval answers) as a batch for :meth:`prepare` with ``scoring``."""
        samples = self.my_samples(rollout, prompt_indices, prompt_groups)
        return InFlight(-1, {}, prompt_indices, rollout, samples, self.exchange.assign(samples))

    def coefficients(self, batch: InFlight, rows: dict, *, confidence: bool = True) -> tuple[list[torch.Tensor], dict]:
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

    def _coefficients(self, batch: InFlight, rows: dict, alpha, total: int, groups: int):
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

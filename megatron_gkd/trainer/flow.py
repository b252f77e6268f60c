"""From a step's prompts to its micro-batches: sampling (through the run's
:class:`~megatron_gkd.trainer.rollout.Rollout`), this rank's teacher request, and the teacher rows and loss
coefficients each micro-batch carries.

Every rank runs the same calls in the same order (they are collectives on the control group, the TP
group or the rollout server's group); a failure on one rank (a teacher past its deadline) stops every
rank at the same point (:func:`megatron_gkd.parallel.comm.agree`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging

import numpy as np
import torch
import torch.distributed as dist

from megatron_gkd import platform
from megatron_gkd.config import needs_teacher
from megatron_gkd.config.checks import generating_teacher
from megatron_gkd.parallel.comm import agree, all_gather_msgpack, broadcast_msgpack
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.teacher import GenerateBatch, ScoreBatch
from megatron_gkd.trainer.batch import (
    TCADSpec,
    TeacherRows,
    TeacherShare,
    build_microbatch,
    common_shape,
    plan_microbatches,
    samples_from_rollout,
    score_batch,
    split_to_count,
    teacher_rows,
    token_coefficients,
)
from megatron_gkd.trainer.components import build_reward_runner
from megatron_gkd.trainer.eval import SCORERS, response_text
from megatron_gkd.trainer.head_check import TeacherHeadMismatch, check_due, check_teacher_head, where
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
from megatron_gkd.trainer.teachers import Request, Teachers
from megatron_gkd.xtok.align import Kind

logger = logging.getLogger(__name__)


class TeacherFailed(RuntimeError):
    """One of several teachers failed: the run stops after its last complete step, naming the teacher."""

    def __init__(self, name: str, error: BaseException):
        super().__init__(f"teacher {name!r} failed: {type(error).__name__}: {error}")
        self.name = name


@dataclasses.dataclass
class InFlight:
    """A batch on its way to the update that trains it (see :mod:`.schedulers`).

    Attributes:
        index: the batch (= step) index.
        data_state: the sampler's state before this batch's prompts were drawn (resuming re-samples it).
        prompt_indices: dataset rows of the batch's prompts, in group order.
        rollout: the sampled batch (all samples of all data-parallel ranks).
        samples: this rank's data-parallel share.
        teacher: this rank's requests ``{teacher name: Request}`` (ranks that ask a teacher), or None.
        pending: disaggregated rollout: the future of ``(rollout, samples, teacher, reward)`` from the rollout thread.
        reward: the future of this rank's rewards (:mod:`.reward_exchange`; ranks that compute them), or None.
        rewards: this rank's rewards, one per sample, once :meth:`BatchFlow.prepare` has them, or None.
        sources: each prompt's source (``student``, ``dataset`` or ``teacher``) with ``sample_mix``, else None.
        answers: each prompt's answer (None where it has none) with ``sample_mix``, else None.
    """

    index: int
    data_state: dict
    prompt_indices: list[int]
    rollout: RolloutBatch | None
    samples: list | None
    teacher: object = None
    pending: object = None
    reward: object = None
    rewards: list[float] | None = None
    sources: list[str] | None = None
    answers: list[str | None] | None = None

    def resolve(self) -> None:
        """Waits for a rollout still running on the rollout server (a no-op otherwise)."""
        if self.pending is not None:
            self.rollout, self.samples, self.teacher, self.reward = self.pending.result()
            self.pending = None


class BatchFlow:
    """Samples batches and turns them, with the teacher's rows, into micro-batches.

    Args:
        config: the run's config.
        state: the parallel state.
        control: a gloo group over every rank.
        dp_group: a gloo group over the data-parallel ranks.
        tokenizer: the student's tokenizer (vocabulary size, EOS, padding).
        timers: the trainer's phase timers.
        teachers: the run's :class:`~megatron_gkd.trainer.teachers.Teachers` (the trainer connects their clients
            and loads their heads).
        rollout: the run's :class:`~megatron_gkd.trainer.rollout.Rollout` (None when nothing is sampled).
        stop_ids: ids that end a response (stripped before its reward is computed).
    """

    def __init__(self, config, state, *, control, dp_group, tokenizer, timers, teachers: Teachers, rollout=None,
                 stop_ids=()):
        self.config, self.state, self.control, self.dp_group = config, state, control, dp_group
        self.tokenizer, self.timers, self.rollout, self.stop_ids = tokenizer, timers, rollout, tuple(stop_ids)
        self.loss_kind = config.trainer.run_mode.loss_kind
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.rank = dist.get_rank()
        self.teachers = teachers
        # One rank per TP group of the last stage asks a remote teacher and sends the rows to its TP group.
        self.is_teacher_rank = state.is_pipeline_last_stage and state.tp_rank == 0
        # Rewards are computed where the teacher is asked, each rank's for its share; their worker starts now.
        self.rewards = RewardExchange(enabled=config.reward.enabled, control=control, timers=timers,
                                      runner=build_reward_runner(config, asks=self.is_teacher_rank),
                                      tokenizer=tokenizer, stop_token_ids=stop_ids)
        self.confidence: dict = {}
        self.tcad = {teacher.name: self._tcad_spec(teacher.config) for teacher in teachers}
        self._heads_checked = False  # the first batch checks every hidden-signal teacher's head
        self.mix = config.sample_mix
        self.generator = generating_teacher(config)  # the teacher that writes responses (sample_mix), or None
        if self.generator is not None:
            # One rank asks for every teacher-written response of a batch (the teacher rank of the first data-parallel
            # share): the responses then do not depend on the layout. Collective over every rank.
            asker = torch.tensor([self.rank if self.is_teacher_rank and state.dp_rank == 0 else -1])
            dist.all_reduce(asker, op=dist.ReduceOp.MAX, group=control)
            self._generator_rank = int(asker)

    # -------------------------------------------------------------------------------------- sampling
    def produce(self, index: int, records, data_state: dict, version: int) -> InFlight:
        """Samples (or reads, or asks the teacher for) the responses of ``records`` and sends this rank's teacher
        request (and its rewards' request)."""
        config = self.config
        prompt_indices = [record.index for record in records]
        prompt_groups = [record.group for record in records]
        fields = {record.index: {"index": record.index, "answer": record.answer, "group": record.group}
                  for record in records}
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
        samples = self.my_samples(rollout, prompt_indices, prompt_groups, sources)
        teacher = None
        if needs_teacher(config):
            with self.timers("teacher_send"):
                teacher = self.request(samples)
        reward = self.rewards.send(samples, fields)  # decoded here, computed in the reward worker meanwhile
        return InFlight(index, data_state, prompt_indices, rollout, samples, teacher, reward=reward, sources=sources,
                        answers=answers)

    def _background_share(self, rollout, prompt_indices, prompt_groups, fields, sources=None):
        """On the rollout thread: the server's batch and this rank's teacher and reward requests for its share (a
        colocated Megatron teacher is a collective of the training ranks: it is asked in the update)."""
        samples = self.my_samples(rollout, prompt_indices, prompt_groups, sources)
        teacher = self.request(samples, local=False) if needs_teacher(self.config) else None
        return rollout, samples, teacher, self.rewards.send(samples, fields)

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
        if self.mix.source == "dataset":
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

    def my_samples(self, rollout: RolloutBatch, prompt_indices: list[int], prompt_groups: list | None = None,
                   sources: list[str] | None = None) -> list:
        """This data-parallel rank's samples: a contiguous block of whole prompt groups."""
        groups = np.array_split(np.arange(len(prompt_indices)), self.state.data_parallel_size)
        mine = set(groups[self.state.dp_rank].tolist())
        rows = [i for i in range(rollout.num_samples) if int(rollout.group_ids[i]) in mine]
        return samples_from_rollout(rollout, rows, prompt_indices, prompt_groups, sources)

    # --------------------------------------------------------------------------------------- teacher
    def _tcad_spec(self, teacher) -> TCADSpec | None:
        loss = self.config.loss
        if self.loss_kind != "distill" or loss.type != "tcad" or teacher.signal == "hidden":
            return None  # the hidden signal's support is the whole vocabulary
        width = loss.support_k or teacher.top_k
        if loss.support_mode == "union":
            width = teacher.top_k + self.config.rollout.logprobs_k
        return TCADSpec(support_k=width, mode=loss.support_mode)

    def asks(self, teacher) -> bool:
        """Whether this rank sends ``teacher``'s requests (one rank per TP group of the last stage asks a remote
        teacher and sends the rows to its TP group; a colocated teacher is a collective of every rank)."""
        return teacher.local or self.is_teacher_rank

    def request(self, samples, *, local: bool | None = None, tcad: bool = True, skip=()) -> dict[str, Request]:
        """This rank's requests, one per teacher that scores some of ``samples`` (TCAD also asks for the student's
        top-k ids). ``local``: only the colocated (True) or only the remote (False) teachers; ``skip``: teachers
        already asked."""
        plan = self.teachers.assign([s.data_group for s in samples])
        requests = {}
        for teacher in self.teachers:
            config, indices = teacher.config, plan[teacher.name]
            if not indices or not self.asks(teacher) or local not in (None, teacher.local) or teacher.name in skip:
                continue
            if teacher.cross is not None:
                requests[teacher.name] = self._cross_request(teacher, [samples[i] for i in indices], indices)
                continue
            batch = score_batch([samples[i] for i in indices], top_k=config.top_k, temperature=config.temperature,
                                vocab_size=len(self.tokenizer),
                                request_student_topk=tcad and self.tcad[teacher.name] is not None,
                                signal=config.signal, hidden_dtype=config.hidden_dtype)
            requests[teacher.name] = Request(indices, teacher.client.score_async(batch))
        return requests

    @staticmethod
    def _cross_request(teacher, samples, indices: list[int]) -> Request:
        """A teacher of another tokenizer is asked the samples' text in its own ids (:mod:`megatron_gkd.xtok.request`);
        its rows come back on the student's response positions."""
        config, cross = teacher.config, teacher.cross
        translated = [cross.translate(sample.tokens.numpy(), sample.prompt_len) for sample in samples]
        batch = ScoreBatch(sequences=[t.sequence for t in translated], top_k=config.top_k,
                           temperature=config.temperature, signal=config.signal, hidden_dtype=config.hidden_dtype)
        asked = teacher.client.score_async(batch)
        moved: concurrent.futures.Future = concurrent.futures.Future()

        def done(future) -> None:
            try:
                moved.set_result([cross.student_output(output, t) for output, t in zip(future.result(), translated,
                                                                                       strict=True)])
            except BaseException as caught:  # noqa: BLE001 - the step's wait raises it
                moved.set_exception(caught)

        asked.add_done_callback(done)
        return Request(indices, moved, translated=translated)

    def teacher_outputs(self, requests: dict[str, Request] | None) -> dict[str, list]:
        """Every teacher's outputs of this rank's requests; every rank stops if any rank's request failed (with
        several teachers, the error names the teacher)."""
        outputs, error = {}, None
        with self.timers("teacher_wait"):
            for name, request in (requests or {}).items():
                try:
                    outputs[name] = request.future.result()
                except Exception as caught:  # noqa: BLE001 - shared with every rank below
                    error = caught if not self.teachers.several else TeacherFailed(name, caught)
                    break
            agree(error, self.control)
        return outputs

    def rows(self, samples, outputs: dict[str, list], tcad: bool = True) -> dict[str, tuple[list[int], TeacherRows]]:
        """Each teacher's rows of the samples it scores on the last stage (sent by the TP group's teacher rank),
        with their indices in ``samples``; nothing elsewhere."""
        if not self.state.is_pipeline_last_stage:
            return {}
        plan = self.teachers.assign([s.data_group for s in samples])
        found = {}
        for teacher in self.teachers:  # every teacher, so that every micro-batch has the same slices and statistics
            indices = plan[teacher.name]
            chosen = [samples[i] for i in indices]
            spec = self.tcad[teacher.name] if tcad else None
            mine = outputs.get(teacher.name)
            if not indices:
                rows = self._no_rows(teacher, spec)
            elif mine is not None:
                rows = teacher_rows(mine, chosen, tcad=spec, vocab_size=len(self.tokenizer))
            else:
                rows = None
            if indices and not teacher.local and dist.get_world_size(self.state.tp_group) > 1:
                rows = self._share_rows(rows, chosen, teacher, spec)
            found[teacher.name] = (indices, rows)
        return found

    def _widths(self, teacher, tcad: TCADSpec | None) -> tuple[int, int | None]:
        """Ids per row and hidden size of ``teacher``'s rows."""
        hidden_size = int(teacher.head.shape[1]) if teacher.config.signal == "hidden" else None
        return (0 if hidden_size else tcad.width if tcad else teacher.config.top_k), hidden_size

    def _no_rows(self, teacher, tcad: TCADSpec | None) -> TeacherRows:
        """Rows of a teacher that scores none of this rank's samples (every sample gets padding from it)."""
        width, hidden_size = self._widths(teacher, tcad)
        return TeacherRows(torch.zeros(0, width, dtype=torch.int64), torch.zeros(0, width), torch.zeros(0),
                           None if hidden_size is None else torch.zeros(0, hidden_size))

    def _share_rows(self, rows: TeacherRows | None, samples, teacher, tcad: TCADSpec | None) -> TeacherRows:
        """The TP group's teacher rank sends its rows to the other ranks of the group."""
        total = sum(s.response_len for s in samples)
        width, hidden_size = self._widths(teacher, tcad)
        device = platform.device()
        ids = rows.ids.to(device) if rows else torch.empty(total, width, dtype=torch.int64, device=device)
        logprobs = rows.logprobs.to(device) if rows else torch.empty(total, width, dtype=torch.float32, device=device)
        tokens = rows.token_logprobs.to(device) if rows else torch.empty(total, dtype=torch.float32, device=device)
        tensors = [ids, logprobs, tokens]
        if hidden_size:
            tensors.append(rows.hidden.to(device) if rows else
                           torch.empty(total, hidden_size, dtype=torch.float32, device=device))
        source = dist.get_global_rank(self.state.tp_group, 0)
        for tensor in tensors:
            dist.broadcast(tensor, src=source, group=self.state.tp_group)
        return TeacherRows(*(tensor.cpu() for tensor in tensors))

    def annotation_metrics(self, batch: InFlight) -> dict:
        """The teachers', the rewards' and the mixture's metrics of a trained batch (collective over every rank)."""
        metrics = {**self.teacher_metrics(batch.teacher, batch.samples), **self.rewards.metrics(batch.rewards)}
        if batch.sources is not None:  # from the global batch, the same on every rank
            metrics.update(source_metrics(batch.rollout, batch.sources, self.mix.source, self.mix.lmbda_at(batch.index),
                                          sample_scores(batch.rollout, batch.answers, self._score)))
        return metrics

    def _score(self, response: list[int], answer: str) -> float:
        """One response's score against its prompt's answer with ``eval.scorer``, as the eval reads an answer."""
        return float(SCORERS.get(self.config.eval.scorer)(response_text(self.tokenizer, response, self.stop_ids), answer))

    def teacher_metrics(self, requests: dict[str, Request] | None, samples) -> dict[str, float]:
        """Per teacher: request latency (the slowest rank's), response tokens scored and attempts retried so far
        (summed over the ranks that ask it). Collective over every rank."""
        requests = requests or {}
        names = self.teachers.names
        latency = torch.tensor([requests[n].latency_s or 0.0 if n in requests else 0.0 for n in names],
                               dtype=torch.float64)
        counts = torch.tensor([[sum(samples[i].response_len for i in requests[n].indices) if n in requests else 0,
                                teacher.client.num_retries if teacher.client is not None and self.asks(teacher) else 0]
                               for n, teacher in zip(names, self.teachers)], dtype=torch.float64)
        dist.all_reduce(latency, op=dist.ReduceOp.MAX, group=self.control)
        dist.all_reduce(counts, group=self.control)
        metrics = {}
        for index, name in enumerate(names):
            prefix = f"teacher{self.teachers.suffix(name)}/"
            metrics.update({f"{prefix}latency_s": float(latency[index]), f"{prefix}tokens_scored": float(counts[index, 0]),
                            f"{prefix}retries": float(counts[index, 1])})
        metrics.update(self._alignment_metrics(requests))
        if self.teachers.several:
            metrics["teacher/retries"] = float(counts[:, 1].sum())
            # Which prompts each teacher scored this step: a record of the routing, per sample.
            asked = {name: sorted({samples[i].prompt_index for i in request.indices})
                     for name, request in requests.items() if not self.teachers.by_name[name].local or self.rank == 0}
            for name in names:
                scored = {index for part in all_gather_msgpack(asked.get(name, []), self.control) for index in part}
                metrics[f"teacher/{name}/prompts"] = sorted(scored)
        return metrics

    def _alignment_metrics(self, requests: dict[str, Request]) -> dict[str, float]:
        """Per cross-tokenizer teacher: the share of the step's response tokens in each kind of aligned group
        (``xtok/share/<kind>``), the share compared with the teacher at a group's head (``xtok/compared``) and through
        the chain rule inside n:1 and n:m groups (``xtok/chained``), and the samples left unaligned
        (``xtok/unaligned_samples``), summed over the ranks that ask it. Collective over every rank when the run has
        such a teacher."""
        crossed = [teacher for teacher in self.teachers if teacher.cross is not None]
        if not crossed:
            return {}
        kinds = [kind.name.lower() for kind in Kind]
        columns = [*kinds, "compared", "total", "chained"]
        counts = torch.zeros(len(crossed), len(columns) + 1, dtype=torch.float64)
        for row, teacher in enumerate(crossed):
            for translated in (requests[teacher.name].translated if teacher.name in requests else None) or ():
                found = translated.alignment.counts()
                found["chained"] = int(translated.chained.sum())
                # A chained head is counted once, as chained.
                found["compared"] -= int((translated.chained & translated.alignment.head).sum())
                counts[row, :-1] += torch.tensor([float(found[column]) for column in columns], dtype=torch.float64)
                counts[row, -1] += 0.0 if translated.aligned else 1.0
        dist.all_reduce(counts, group=self.control)
        metrics = {}
        for row, teacher in enumerate(crossed):
            found = dict(zip(columns, counts[row].tolist()))
            prefix, total = f"xtok{self.teachers.suffix(teacher.name)}/", max(found["total"], 1.0)
            metrics.update({f"{prefix}share/{kind}": found[kind] / total for kind in kinds})
            metrics[f"{prefix}compared"] = found["compared"] / total
            metrics[f"{prefix}chained"] = found["chained"] / total
            metrics[f"{prefix}unaligned_samples"] = float(counts[row, -1])
        return metrics

    # -------------------------------------------------------------------------------- micro-batches
    def prepare(self, batch: InFlight, *, scoring: bool = False) -> list:
        """Waits for the batch and its teacher rows, and cuts it into micro-batches.

        ``scoring``: the micro-batches that score the batch against every teacher whatever the mode (eval's KL):
        the teachers' own top-k (no TCAD support), no confidence weights, no labels.
        """
        with self.timers("rollout_wait"):
            batch.resolve()
        if scoring or needs_teacher(self.config):
            asked = batch.teacher if batch.teacher is not None else {}
            # A colocated Megatron teacher is a collective of the training ranks: it is asked here, in the update.
            asked.update(self.request(batch.samples, local=None if scoring else True, skip=asked, tcad=not scoring))
            batch.teacher = asked
        outputs = self.teacher_outputs(batch.teacher)
        if not scoring:  # computed meanwhile; waited for after the teacher's rows (a no-op without rewards)
            batch.rewards = self.rewards.receive(batch.reward)
        with self.timers("batch"):
            rows = self.rows(batch.samples, outputs, tcad=not scoring) if scoring or self.loss_kind == "distill" else {}
            self.check_heads(batch, rows, scoring=scoring)
            coefficients = self.coefficients(batch, rows, confidence=not scoring)
            policy = None if scoring else self.policy(batch, rows)
            if policy is not None and not self.config.rl.combination.uses_divergence:
                rows = {}  # the teacher is in the advantage only: no divergence term
            elif policy is not None:  # rl.combine=loss: the divergence weighs rl.kd_coef beside the policy gradient
                coefficients = [c * self.config.rl.kd_coef for c in coefficients]
            sources = (STUDENT, self.mix.source) if self.mix.enabled and not scoring else None
            return self.microbatches(batch.samples, coefficients, rows, labels=False if scoring else None,
                                     policy=policy, sources=sources)

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
                            num_sequences=batch.rollout.num_samples)

    def check_heads(self, batch: InFlight, rows: dict, *, scoring: bool = False) -> None:
        """The hidden signal, on the first batch and every ``head_check_interval`` steps: each teacher's own token
        log-probs against ``hidden @ head`` on a sample of tokens (:mod:`.head_check`); a mismatch stops every rank.
        Collective over every rank when any check is due."""
        first, self._heads_checked = not self._heads_checked, True
        # A cross-tokenizer teacher's rows sit on the student's positions, whose ids are not its own: not checked here.
        due = [t for t in self.teachers
               if t.cross is None and check_due(t.config, batch.index, first=first, scoring=scoring)]
        if not due:
            return
        error, tp_group = None, self.state.tp_group if dist.get_world_size(self.state.tp_group) > 1 else None
        for teacher in due:
            indices, found = rows.get(teacher.name, ((), None))
            if not indices or teacher.head is None:  # not the last stage, or no sample of this rank goes to it
                continue
            try:
                agreement = check_teacher_head(found, [batch.samples[i] for i in indices], teacher.head,
                                               key=self.teachers.key(teacher.name), config=teacher.config,
                                               tp_group=tp_group, real_vocab_size=len(self.tokenizer), step=batch.index)
            except TeacherHeadMismatch as caught:
                error = caught
                break
            if self.state.tp_rank == 0 and self.state.dp_rank == 0:
                logger.log(logging.INFO if first else logging.DEBUG, "teacher %r head check %s: %s", teacher.name,
                           where(batch.index), agreement.describe(teacher.config.head_check_tolerance))
        agree(error, self.control)

    def scoring_batch(self, rollout: RolloutBatch, prompt_indices: list[int], prompt_groups: list) -> InFlight:
        """``rollout`` (sampled elsewhere, e.g. eval answers) as a batch for :meth:`prepare` with ``scoring``."""
        return InFlight(-1, {}, prompt_indices, rollout, self.my_samples(rollout, prompt_indices, prompt_groups))

    def coefficients(self, batch: InFlight, rows: dict, *, confidence: bool = True) -> list[torch.Tensor]:
        """Each response token's share of the step's loss (see :mod:`.batch`), on the last stage (``confidence``:
        TCAD's confidence weights where ``loss.confidence_alpha`` asks for them)."""
        samples, alpha = batch.samples, self.config.loss.confidence_alpha if confidence else None
        if not self.state.is_pipeline_last_stage:
            return [torch.zeros(s.response_len, dtype=torch.float64) for s in samples]
        total, groups = batch.rollout.num_generated_tokens, len(batch.prompt_indices)
        if alpha is None or not rows:
            return token_coefficients(samples, total_tokens=total, num_groups=groups)
        # Each sample's confidence comes from the one teacher that scores it (route; mixtures refuse alpha).
        token_logprobs: list = [None] * len(samples)
        for indices, teacher_rows_ in rows.values():
            for index, values in zip(indices, teacher_rows_.token_logprobs.split([samples[i].response_len
                                                                                  for i in indices])):
                token_logprobs[index] = values
        coefficients = token_coefficients(samples, total_tokens=total, num_groups=groups,
                                          teacher_token_logprobs=token_logprobs, confidence_alpha=alpha)
        self.confidence = self._confidence_weights(samples, coefficients, groups)
        return coefficients

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
                     sources=None) -> list:
        """The micro-batches of ``samples`` (every rank of a pipeline plans the same cuts; ``policy``: the
        policy-gradient inputs of ``samples``, a :class:`~megatron_gkd.trainer.batch.PolicyShare`; ``sources``: the
        mixture's source names, whose losses are measured apart)."""
        trainer, parallel = self.config.trainer, self.config.parallel
        plan = plan_microbatches([s.input_len for s in samples], micro_batch_size=trainer.micro_batch_size,
                                 max_tokens=trainer.max_tokens_per_microbatch)
        shares = self.shares(samples, coefficients, rows)
        multiple = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
        labels = self.loss_kind == "cross_entropy" if labels is None else labels
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
                                 policy=None if policy is None else policy.take(indices), sources=sources)
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

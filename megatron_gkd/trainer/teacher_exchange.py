"""A batch's teacher exchange: which teacher scores which sample, the requests, the wait for their outputs, the
teacher rows on every rank of the last stage's TP group, the hidden signal's head check and the per-teacher
metrics.

It is the first of a batch's annotators (:mod:`.annotations`): :class:`~megatron_gkd.trainer.flow.BatchFlow` sends it
a batch's samples when they are made and receives its rows in the update, as it does the rewards':

==================================  ==========================================================================
call                                what it does
==================================  ==========================================================================
``send(samples, records, index)``   ``assign``: the samples each teacher scores (route or mixture, :mod:`.teachers`),
                                    recorded once; ``request``: the remote teachers asked (a colocated one too
                                    unless the samples were made on the rollout thread) -> :class:`Asked`
``receive(asked)``                  a colocated Megatron teacher asked now (a collective of the training ranks);
                                    ``outputs``: every request waited for, a failure on any rank stops every rank;
                                    ``rows``: ``TeacherRows`` per teacher on the last stage (the asking rank's,
                                    broadcast to its TP group); ``check_heads``: the hidden signal's head against
                                    the teacher's own log-probs, when due -> :class:`Scored`
``metrics(scored, samples)``        latency, tokens scored, retries, the routing, cross-tokenizer alignment shares
==================================  ==========================================================================

Eval's scoring of a batch against every teacher whatever the mode calls ``receive(..., scoring=True)`` on an
:class:`Asked` of the assignment alone. Every rank runs the same calls in the same order (collectives on the control
group or the TP group); a failure on one rank stops every rank at the same point
(:func:`megatron_gkd.parallel.comm.agree`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging

import torch
import torch.distributed as dist

from megatron_gkd import platform
from megatron_gkd.config import needs_teacher
from megatron_gkd.parallel.comm import agree, all_gather_msgpack
from megatron_gkd.teacher import ScoreBatch
from megatron_gkd.teacher.protocol.types import Signal
from megatron_gkd.trainer.batch import TCADSpec, TeacherRows, score_batch, teacher_rows
from megatron_gkd.trainer.head_check import TeacherHeadMismatch, check_due, check_teacher_head, where
from megatron_gkd.trainer.teachers import Request, Teachers
from megatron_gkd.xtok.align import Kind

logger = logging.getLogger(__name__)


class TeacherFailed(RuntimeError):
    """One of several teachers failed: the run stops after its last complete step, naming the teacher."""

    def __init__(self, name: str, error: BaseException):
        super().__init__(f"teacher {name!r} failed: {type(error).__name__}: {error}")
        self.name = name


@dataclasses.dataclass
class Asked:
    """A batch's teacher handle between sampling and the update (:meth:`TeacherExchange.send`).

    Attributes:
        index: the batch index (the head check's schedule reads it; -1: eval's scoring).
        samples: this rank's samples (:class:`~megatron_gkd.trainer.batch.Sample`).
        assignment: the indices in ``samples`` that each teacher scores ``{teacher name: [index]}``; every later use
            reads it.
        requests: this rank's requests sent so far ``{teacher name: Request}``, or None.
    """

    index: int
    samples: list
    assignment: dict[str, list[int]]
    requests: dict[str, Request] | None = None


@dataclasses.dataclass
class Scored:
    """A batch's teacher annotation (:meth:`TeacherExchange.receive`).

    Attributes:
        rows: each teacher's rows of this rank's samples with their indices ``{name: (indices, TeacherRows)}`` (the
            last stage; empty elsewhere and where no divergence is trained).
        requests: the requests they answered ``{teacher name: Request}`` (their latency, retries, alignment).
    """

    rows: dict
    requests: dict


class TeacherExchange:
    """This rank's side of the teachers for one batch after another.

    Args:
        config: the run's config.
        state: the parallel state (last stage, TP rank and group, DP rank).
        control: a gloo group over every rank.
        tokenizer: the student's tokenizer (its length is the real vocabulary size).
        timers: the trainer's phase timers (``teacher_wait``).
        teachers: the run's :class:`~megatron_gkd.trainer.teachers.Teachers` (the trainer connects their clients
            and loads their heads).
    """

    def __init__(self, config, state, *, control, tokenizer, timers, teachers: Teachers):
        self.config, self.state, self.control = config, state, control
        self.tokenizer, self.timers, self.teachers = tokenizer, timers, teachers
        self.rank = dist.get_rank()
        # One rank per TP group of the last stage asks a remote teacher and sends the rows to its TP group.
        self.is_teacher_rank = state.is_pipeline_last_stage and state.tp_rank == 0
        self.tcad = {teacher.name: self._tcad_spec(teacher.config) for teacher in teachers}
        self._heads_checked = False  # the first batch checks every hidden-signal teacher's head

    def _tcad_spec(self, teacher) -> TCADSpec | None:
        loss = self.config.loss
        if not (self.config.trainer.run_mode.loss_kind.needs_teacher and loss.divergence.student_support
                and Signal(teacher.signal).sends_topk):
            return None  # the hidden signal's support is the whole vocabulary
        width = loss.support_k or teacher.top_k
        if loss.support_mode == "union":
            width = teacher.top_k + self.config.rollout.logprobs_k
        return TCADSpec(support_k=width, mode=loss.support_mode)

    # ------------------------------------------------------------------------ the batch's annotation
    name = "teacher"
    """Where a batch keeps its handle and its rows (``InFlight.sent``, ``InFlight.annotations``)."""

    def wait_ready(self) -> None:
        """Nothing to wait for: the trainer connects and checks the teachers (:class:`~.teachers.Teachers`) before the
        first batch."""

    def send(self, samples, records=None, *, index: int, background: bool = False) -> Asked:
        """Batch ``index``'s assignment and the requests sent now: every teacher's, or with ``background`` (the
        samples were made on the rollout thread while the training ranks train) the remote ones only, a colocated
        teacher being a collective of the training ranks (:meth:`receive` asks it). ``records`` are not read."""
        assignment = self.assign(samples)
        if not needs_teacher(self.config):
            return Asked(index, samples, assignment)
        if background:  # the rollout thread: not timed (the phase timers are the training ranks')
            return Asked(index, samples, assignment, self.request(samples, assignment, local=False))
        with self.timers("teacher_send"):
            return Asked(index, samples, assignment, self.request(samples, assignment))

    def receive(self, asked: Asked, *, scoring: bool = False) -> Scored:
        """The batch's rows: a colocated teacher asked now, every request waited for, the rows shared over the TP
        group, the head check when due (collective over every rank). ``scoring``: eval's scoring against every
        teacher whatever the mode (the teachers' own top-k, no TCAD support; the head check only if it is the run's
        first batch)."""
        samples, assignment, requests = asked.samples, asked.assignment, dict(asked.requests or {})
        distills = scoring or needs_teacher(self.config)
        if distills:
            requests.update(self.request(samples, assignment, local=None if scoring else True, skip=requests,
                                         tcad=not scoring))
        outputs = self.outputs(requests)
        with self.timers("batch"):
            rows = self.rows(samples, assignment, outputs, tcad=not scoring) if distills else {}
            self.check_heads(asked.index, samples, rows, scoring=scoring)
        return Scored(rows, requests)

    def close(self) -> None:
        """Nothing to close: the trainer closes the teachers' clients."""

    # ------------------------------------------------------------------------------------- the parts
    def asks(self, teacher) -> bool:
        """Whether this rank sends ``teacher``'s requests (one rank per TP group of the last stage asks a remote
        teacher and sends the rows to its TP group; a colocated teacher is a collective of every rank)."""
        return teacher.local or self.is_teacher_rank

    def assign(self, samples) -> dict[str, list[int]]:
        """The indices in ``samples`` that each teacher scores, by the samples' record groups (nothing without a
        teacher). A batch records it once, when its samples are made."""
        return self.teachers.assign([s.data_group for s in samples]) if len(self.teachers) else {}

    # -------------------------------------------------------------------------------------- requests
    def request(self, samples, plan: dict[str, list[int]], *, local: bool | None = None, tcad: bool = True,
                skip=()) -> dict[str, Request]:
        """This rank's requests, one per teacher that scores some of ``samples`` (``plan``: :meth:`assign`'s; TCAD
        also asks for the student's top-k ids). ``local``: only the colocated (True) or only the remote (False)
        teachers; ``skip``: teachers already asked."""
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
        """A teacher of another tokenizer is asked the samples' text in its own ids (:mod:`megatron_gkd.teacher.clients.cross_request`);
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

    def outputs(self, requests: dict[str, Request] | None) -> dict[str, list]:
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

    # ------------------------------------------------------------------------------------------ rows
    def rows(self, samples, plan: dict[str, list[int]], outputs: dict[str, list],
             tcad: bool = True) -> dict[str, tuple[list[int], TeacherRows]]:
        """Each teacher's rows of the samples it scores on the last stage (sent by the TP group's teacher rank),
        with their indices in ``samples`` (``plan``: :meth:`assign`'s); nothing elsewhere."""
        if not self.state.is_pipeline_last_stage:
            return {}
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
        hidden_size = int(teacher.head.shape[1]) if Signal(teacher.config.signal).needs_head else None
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

    def check_heads(self, index: int, samples, rows: dict, *, scoring: bool = False) -> None:
        """The hidden signal, on the first batch and every ``head_check_interval`` steps: each teacher's own token
        log-probs against ``hidden @ head`` on a sample of tokens of batch ``index`` (:mod:`.head_check`); a mismatch
        stops every rank. Collective over every rank when any check is due."""
        first, self._heads_checked = not self._heads_checked, True
        # A cross-tokenizer teacher's rows sit on the student's positions, whose ids are not its own: not checked here.
        due = [t for t in self.teachers
               if t.cross is None and check_due(t.config, index, first=first, scoring=scoring)]
        if not due:
            return
        error, tp_group = None, self.state.tp_group if dist.get_world_size(self.state.tp_group) > 1 else None
        for teacher in due:
            indices, found = rows.get(teacher.name, ((), None))
            if not indices or teacher.head is None:  # not the last stage, or no sample of this rank goes to it
                continue
            try:
                agreement = check_teacher_head(found, [samples[i] for i in indices], teacher.head,
                                               key=self.teachers.key(teacher.name), config=teacher.config,
                                               tp_group=tp_group, real_vocab_size=len(self.tokenizer), step=index)
            except TeacherHeadMismatch as caught:
                error = caught
                break
            if self.state.tp_rank == 0 and self.state.dp_rank == 0:
                logger.log(logging.INFO if first else logging.DEBUG, "teacher %r head check %s: %s", teacher.name,
                           where(index), agreement.describe(teacher.config.head_check_tolerance))
        agree(error, self.control)

    # --------------------------------------------------------------------------------------- metrics
    def metrics(self, scored: Scored | None, samples) -> dict[str, float]:
        """Per teacher: request latency (the slowest rank's), response tokens scored and attempts retried so far
        (summed over the ranks that ask it). Collective over every rank."""
        requests = scored.requests if scored is not None else {}
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

"""The run's teachers: one (``teacher``) or several (``teachers`` + ``teacher_mix``), and which sample each scores.

Several teachers are separate services (or clients), one per teacher, not one service hosting several
models: each keeps its own client, address, top-k, temperature, signal, vocabulary check, retries and
faults, so a teacher that fails is named and the others' code paths are the single-teacher ones. A step
sends each teacher one request with the samples it scores:

* ``route``: the teacher its record's group names (``data.group_key``, ``teacher_mix.routes``, ``default``);
* ``mixture``: every teacher scores every sample; the loss is ``sum_j weights[j] x divergence_j``.

Either way the loss of a token is a sum over teachers of ``coefficient_j x divergence_j`` with per-teacher
coefficients (the token's share of the step's loss times the teacher's weight, 0 where the teacher does not
score the sample), so micro-batching and layouts stay exact as with one teacher.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from megatron_gkd.config.checks import teacher_configs, teacher_key
from megatron_gkd.data.tokenization import resolve_chat_template
from megatron_gkd.parallel.comm import agree, broadcast_msgpack
from megatron_gkd.teacher.clients import client_traits
from megatron_gkd.teacher.service.local import ServiceKeeper, TeacherService
from megatron_gkd.trainer.components import build_cross_tokenizer, build_teacher_client, build_teacher_head
from megatron_gkd.trainer.ema import WeightsEMA
from megatron_gkd.trainer.metrics import teacher_suffix


@dataclasses.dataclass
class Teacher:
    """One teacher of the run and what this rank holds of it.

    Attributes:
        name: its name (``teacher`` for a single ``teacher:`` section).
        config: its :class:`~megatron_gkd.teacher.config.TeacherConfig`.
        weight: mixture weight (1 when routed or alone).
        client: the client on the ranks that ask it (built at start-up), else None.
        service: the service this run started for it (rank 0), else None.
        head: its output layer's shard on last-stage ranks (hidden signal), else None.
        cross: a teacher of another tokenizer (``cross_tokenizer.method``): the pair's
            :class:`~megatron_gkd.teacher.clients.cross_request.CrossTokenizer` (its requests are translated, its rows moved back to the
            student's positions), else None.
        projection: ``cross``'s map ``W``, this rank's rows (last stage), for the loss.
        ema: a self teacher's EMA of the student's weights (``self_weights=ema``, every rank), else None.
    """

    name: str
    config: object
    weight: float = 1.0
    client: object = None
    service: object = None
    head: torch.Tensor | None = None
    cross: object = None
    projection: object = None
    ema: WeightsEMA | None = None

    @property
    def local(self) -> bool:
        """A colocated Megatron teacher: a collective of the training ranks, asked by every rank."""
        return client_traits(self.config.client).collective


@dataclasses.dataclass
class Request:
    """One teacher's part of a step: the samples it scores (indices into the rank's samples) and the future
    (``translated``: a cross-tokenizer teacher's view of each sample, :class:`~megatron_gkd.teacher.clients.cross_request.Translated`).
    """

    indices: list[int]
    future: object
    translated: list | None = None
    started: float = dataclasses.field(default_factory=time.perf_counter)
    latency_s: float | None = None

    def __post_init__(self):
        def done(_):
            self.latency_s = time.perf_counter() - self.started

        self.future.add_done_callback(done)


class Teachers:
    """The run's teachers by name, in config order, and how each sample reaches them.

    Args:
        config: the run's :class:`~megatron_gkd.config.GKDConfig`.
    """

    def __init__(self, config):
        mix = config.teacher_mix
        # Each record to one teacher; otherwise (teacher_mix.mode=mixture) every teacher scores it.
        self.routed = mix.is_routed or len(teacher_configs(config)) <= 1
        self._mix = mix
        self.by_name: dict[str, Teacher] = {
            name: Teacher(name, teacher, weight=1.0 if self.routed else mix.weights.get(name, 1.0))
            for name, teacher in teacher_configs(config).items()}
        self._keys = {name: teacher_key(config, name) for name in self.by_name}
        self._keeper: ServiceKeeper | None = None  # rank 0, once the services it started are ready
        self._data = config.data
        self._student = self._tokenizer = None  # build_local_parts: what a teacher that reads the student scores with
        self._records: list = []  # learn_prompts: the records whose privileged prompts such a teacher learns

    def __iter__(self):
        return iter(self.by_name.values())

    def __len__(self) -> int:
        return len(self.by_name)

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    @property
    def several(self) -> bool:
        """Whether metrics and errors name each teacher (more than one)."""
        return len(self.by_name) > 1

    def key(self, name: str) -> str:
        """The teacher's config section (``teacher`` or ``teachers.NAME``)."""
        return self._keys[name]

    def assign(self, groups: Sequence[str | None]) -> dict[str, list[int]]:
        """The samples each teacher scores, by the samples' record groups (indices in order).

        Raises:
            ValueError: a route mode sample's group names no teacher and there is no default.
        """
        everyone = list(range(len(groups)))
        if len(self.by_name) == 1 or not self.routed:
            return {name: everyone for name in self.by_name}
        plan: dict[str, list[int]] = {name: [] for name in self.by_name}
        for index, group in enumerate(groups):
            plan[self._mix.teacher_of(group, self.by_name)].append(index)
        return plan

    @property
    def keep_conversations(self) -> bool:
        """Whether the datasets keep each record's conversation: a teacher of another tokenizer reads it through its
        own chat template (``cross_tokenizer.prompt=template``, :mod:`megatron_gkd.teacher.clients.cross_prompt`)."""
        return any(t.config.enabled and (t.config.cross_tokenizer.enabled and t.config.cross_tokenizer.prompt == "template"
                                         or client_traits(t.config.client).reads_student) for t in self)

    def learn_prompts(self, datasets, asks) -> None:
        """Every teacher of another tokenizer learns its own prompt of each record of ``datasets`` (loaded with
        :attr:`keep_conversations`), and a teacher that is the student learns each record's privileged prompt, on the
        ranks that ask it (``asks(teacher)``): their samples carry ids only."""
        for teacher in self:
            if teacher.cross is not None and asks(teacher):
                teacher.cross.prompts.learn(record for dataset in datasets for record in dataset)
            elif teacher.config.enabled and client_traits(teacher.config.client).reads_student:  # its client, built later, learns them
                self._records = [record for dataset in datasets for record in dataset]

    def suffix(self, name: str) -> str:
        """What a per-teacher metric name ends with (nothing for a single teacher)."""
        return teacher_suffix(name, self.several)

    # ------------------------------------------------------------------------------------ life cycle
    def start_services(self, rank: int, out, control) -> None:
        """Rank 0 starts a service for every teacher with ``serve.model``; every rank stops if one fails."""
        error = None
        if rank == 0:
            try:
                for teacher in self:
                    if teacher.config.serve.model is not None:
                        log = "teacher_service.log" if not self.several else f"teacher_service_{teacher.name}.log"
                        teacher.service = TeacherService(teacher.config.serve, out / log)
            except Exception as caught:  # noqa: BLE001 - every rank stops with it (agree)
                error = caught
        agree(error, control)

    def build_local_parts(self, state, student, tokenizer) -> None:
        """What each teacher needs on this rank besides its client: the tokenizer pair of a teacher of another tokenizer
        and this rank's rows of its map ``W`` (``cross``, ``projection``), and the shard of its output layer (``head``,
        the hidden signal; a cross-tokenizer teacher's split by its own vocabulary)."""
        self._student, self._tokenizer = student, tokenizer
        for teacher in self:
            teacher.cross, teacher.projection = build_cross_tokenizer(teacher.config, state, student, tokenizer)
            teacher.head = build_teacher_head(teacher.config, state, student, tokenizer, teacher.cross)
            if teacher.config.enabled and client_traits(teacher.config.client).reads_student \
                    and teacher.config.self_weights == "ema":
                teacher.ema = WeightsEMA(student, teacher.config.ema_decay, key=f"{self.key(teacher.name)}.ema")

    @property
    def averages(self) -> list[WeightsEMA]:
        """The EMAs of the student's weights that self teachers read: updated after every optimizer step, saved in
        the checkpoints."""
        return [teacher.ema for teacher in self if teacher.ema is not None]

    @property
    def checkpointed(self) -> dict:
        """``{checkpoint key: chunks}`` of the models a checkpoint saves beside the student (the EMAs)."""
        return {ema.key: ema.chunks for ema in self.averages}

    def connect(self, state, asks, check) -> None:
        """Waits for the services this run started, then builds the client of every teacher on the ranks that ask
        it (``asks(teacher)``) and checks it against the run (``check(teacher)``); every rank stops on a failure
        (``state``: the trainer's :class:`~megatron_gkd.parallel.ParallelState`, its control group and the layout a
        colocated teacher is sharded on)."""
        rank, control = state.rank, state.control_group
        started = {}
        for teacher in self:
            address = secret = error = None
            served = teacher.config.serve.model is not None
            if rank == 0 and teacher.service is not None:
                try:
                    address = teacher.service.wait_ready(teacher.config.serve.startup_timeout_s)
                    secret = teacher.service.secret
                    started[teacher.name] = (teacher.service, address)
                except Exception as caught:  # noqa: BLE001
                    error = caught
            agree(error, control)
            if served:
                address, secret = broadcast_msgpack([address, secret], 0, control)
            error = None
            if asks(teacher):
                try:
                    teacher.client = build_teacher_client(teacher.config, address,
                                                          secret.encode() if secret is not None else None, state,
                                                          self._student, self._tokenizer, ema=teacher.ema)
                    if client_traits(teacher.config.client).reads_student:
                        teacher.client.learn(self._records, self._tokenizer,
                                             resolve_chat_template(self._data, self._tokenizer))
                    check(teacher)
                except Exception as caught:  # noqa: BLE001
                    error = caught if not self.several else ValueError(f"{self.key(teacher.name)}: {caught}")
            agree(error, control)
        if started:  # rank 0: a service that dies from now on is replaced
            self._keeper = ServiceKeeper(started)

    def close_clients(self) -> None:
        """Closes every client (each is tried; the first failure is raised after)."""
        _each([teacher.client.close for teacher in self if teacher.client is not None])

    def stop_services(self) -> None:
        """Stops every service this run started (and the keeper that replaces the dead ones)."""
        keeper, self._keeper = self._keeper, None
        _each([keeper.stop] if keeper is not None else [])
        _each([teacher.service.stop for teacher in self if teacher.service is not None])


def _each(actions) -> None:
    error = None
    for action in actions:
        try:
            action()
        except Exception as caught:  # noqa: BLE001 - close the others too
            error = error or caught
    if error is not None:
        raise error

"""The ``sample_mix`` section: GKD's mixture of student samples and off-policy data (Agarwal et al., ICLR 2024;
TRL's ``GKDTrainer(lmbda=..., seq_kd=...)``).

With probability ``lmbda`` a batch's (or a prompt's) responses are the student's own samples (on-policy), otherwise
they come from ``source``: the records' own responses (``dataset``, supervised KD) or responses the teacher writes
(``teacher``, sequence-level KD). The teacher scores every response whatever its source, and the loss reads them
the same way. The section is called ``sample_mix`` beside ``teacher_mix``: ``teacher_mix`` says which teacher
scores a sample, ``sample_mix`` where the sample comes from (``mixture`` alone would read as ``teacher_mix.mode=
mixture``, the weighted divergences of several teachers).

``lmbda`` over the steps (``schedule``):

============  ===================================================================================
``constant``  ``lmbda`` at every step
``linear``    ``lmbda`` at ``ramp_start``, then linearly to ``lmbda_end`` over ``ramp_steps`` steps
``step``      ``lmbda`` until ``milestones[0]``, then ``values[i]`` from step ``milestones[i]`` on
============  ===================================================================================
"""

from __future__ import annotations

import dataclasses
import math

from megatron_gkd.rollout.sources import RESPONSE_SOURCES, SourceTraits

SCHEDULES = ("constant", "linear", "step")
GRANULARITIES = ("batch", "prompt")


def _check_fraction(key: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{key}={value!r} must be a fraction in [0, 1] (the share of on-policy student samples)")


@dataclasses.dataclass(kw_only=True, slots=True)
class TeacherSamplingConfig:
    """How the teacher writes its responses (``sample_mix.source=teacher``): its own sampling settings, not the
    student's (``rollout.*``)."""

    temperature: float = 1.0
    """Sampling temperature of the teacher (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling (1: off)."""
    top_k: int = 0
    """Sample among the k most likely ids (0: off)."""
    max_tokens: int | None = None
    """Longest teacher response; default: ``rollout.max_tokens``."""
    teacher: str | None = None
    """With several ``teachers``: the one that writes the responses (each is still scored as ``teacher_mix`` says)."""

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"sample_mix.teacher.temperature={self.temperature} must be finite and >= 0 (0: greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sample_mix.teacher.top_p={self.top_p} must be in (0, 1] (1: off)")
        if self.top_k < 0:
            raise ValueError(f"sample_mix.teacher.top_k={self.top_k} must be >= 0 (0: off)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"sample_mix.teacher.max_tokens={self.max_tokens} must be >= 1 (or null: "
                             "rollout.max_tokens)")


@dataclasses.dataclass(kw_only=True, slots=True)
class SampleMixConfig:
    """GKD's mixture (see the module docstring). Null ``lmbda`` (the default): off, every response comes from
    ``trainer.mode`` as without this section."""

    lmbda: float | None = None
    """The fraction of on-policy student samples (TRL's name; ``lambda`` is a Python keyword), at the start of the
    schedule; null: no mixture."""
    per: str = "batch"
    """``batch``: the whole batch comes from one source, the student's with probability ``lmbda`` (GKD, TRL);
    ``prompt``: each prompt's source is drawn on its own."""
    source: str = "dataset"
    """The off-policy responses, a registered response source (:mod:`megatron_gkd.rollout.sources`): ``dataset``
    (each record's own response; TRL's ``seq_kd=False``) or ``teacher`` (the teacher writes them with
    ``sample_mix.teacher.*``; TRL's ``seq_kd=True``)."""
    schedule: str = "constant"
    """How ``lmbda`` moves over the steps: ``constant``, ``linear`` or ``step`` (module docstring)."""
    lmbda_end: float | None = None
    """``linear``: the value reached after the ramp."""
    ramp_start: int = 0
    """``linear``: the step the ramp starts at."""
    ramp_steps: int | None = None
    """``linear``: the steps the ramp takes."""
    milestones: list[int] = dataclasses.field(default_factory=list)
    """``step``: the steps (increasing) at which ``lmbda`` changes."""
    values: list[float] = dataclasses.field(default_factory=list)
    """``step``: ``lmbda`` from each milestone on."""
    seed: int | None = None
    """Seeds the draws (with the step: a resumed run draws the same); default: ``trainer.seed``."""
    teacher: TeacherSamplingConfig = dataclasses.field(default_factory=TeacherSamplingConfig)

    def __post_init__(self):
        if self.per not in GRANULARITIES:
            raise ValueError(f"sample_mix.per={self.per!r}; choose 'batch' (one source per batch, as GKD) or 'prompt'")
        if self.source not in RESPONSE_SOURCES:
            names = " or ".join(repr(name) for name in RESPONSE_SOURCES.names())
            raise ValueError(f"sample_mix.source={self.source!r}; choose {names} (registered response sources: "
                             "megatron_gkd.rollout.sources; the student's own samples are the other part of the "
                             "mixture, sample_mix.lmbda of it)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"sample_mix.schedule={self.schedule!r}; choose one of {list(SCHEDULES)}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"sample_mix.seed={self.seed} must be >= 0 (or null: trainer.seed)")
        if self.lmbda is None:
            return
        _check_fraction("sample_mix.lmbda", self.lmbda)
        if self.schedule == "linear":
            if self.lmbda_end is None or self.ramp_steps is None:
                raise ValueError("sample_mix.schedule=linear ramps from sample_mix.lmbda to sample_mix.lmbda_end over "
                                 "sample_mix.ramp_steps steps: set both (e.g. sample_mix.lmbda_end=1.0 "
                                 "sample_mix.ramp_steps=100)")
            _check_fraction("sample_mix.lmbda_end", self.lmbda_end)
            if self.ramp_steps < 1 or self.ramp_start < 0:
                raise ValueError(f"sample_mix.ramp_steps={self.ramp_steps} must be >= 1 and sample_mix.ramp_start="
                                 f"{self.ramp_start} >= 0")
        if self.schedule == "step":
            if not self.milestones or len(self.milestones) != len(self.values):
                raise ValueError(f"sample_mix.schedule=step needs one value per milestone: sample_mix.milestones="
                                 f"{list(self.milestones)} and sample_mix.values={list(self.values)} (e.g. "
                                 "sample_mix.milestones=[100] sample_mix.values=[1.0])")
            if any(b <= a for a, b in zip(self.milestones, self.milestones[1:])) or self.milestones[0] < 1:
                raise ValueError(f"sample_mix.milestones={list(self.milestones)} must be increasing steps >= 1")
            for index, value in enumerate(self.values):
                _check_fraction(f"sample_mix.values[{index}]", value)

    @property
    def source_traits(self) -> SourceTraits:
        """What the off-policy source needs (:class:`~megatron_gkd.rollout.sources.SourceTraits`)."""
        return RESPONSE_SOURCES.traits(self.source)

    @property
    def enabled(self) -> bool:
        return self.lmbda is not None

    def lmbda_at(self, step: int) -> float:
        """``lmbda`` at ``step`` (0-based: the index of the batch) under the schedule."""
        assert self.lmbda is not None, "no mixture: sample_mix.lmbda is null"
        if self.schedule == "linear":
            progress = min(max(step - self.ramp_start, 0) / self.ramp_steps, 1.0)
            return self.lmbda + (self.lmbda_end - self.lmbda) * progress
        if self.schedule == "step":
            passed = [value for milestone, value in zip(self.milestones, self.values) if step >= milestone]
            return passed[-1] if passed else self.lmbda
        return self.lmbda

    def never_student(self, num_steps: int) -> bool:
        """Whether no step of ``0 .. num_steps - 1`` draws the student's own samples (``lmbda`` 0 throughout: pure
        off-policy data, e.g. sequence-level KD from a cache of teacher-written responses). The schedules are
        monotone between their breakpoints, so the first step, the last and each milestone decide."""
        if not self.enabled:
            return False
        steps = {0, max(num_steps - 1, 0)}
        if self.schedule == "step":
            steps |= {milestone for milestone in self.milestones if milestone < num_steps}
        return all(self.lmbda_at(step) == 0 for step in steps)

    def inert_options(self) -> list[str]:
        """Options set away from their defaults that the chosen path ignores (the config checks warn about them)."""
        inert = []
        if self.schedule != "linear" and (self.lmbda_end is not None or self.ramp_steps is not None
                                          or self.ramp_start != 0):
            inert.append("sample_mix.lmbda_end / ramp_steps / ramp_start (schedule=linear only)")
        if self.schedule != "step" and (self.milestones or self.values):
            inert.append("sample_mix.milestones / values (schedule=step only)")
        if not self.source_traits.teacher_writes and self.teacher != TeacherSamplingConfig():
            inert.append("sample_mix.teacher.* (source=teacher only)")
        return inert

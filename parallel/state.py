"""Model-parallel initialisation: the only place that builds Megatron-Core's process groups and the trainer's
control group.

:func:`initialize` returns the :class:`ParallelState`; the entry point that calls it hands it down, and everything
else receives the state (or the groups in it) as an argument, or from the model it was given
(``models.parallel_state_of``). :func:`get_state` is for entry points (and ``models.build_model``'s default for
scripts and tests); ``tests/unit/test_code_habits.py`` keeps library code from calling it.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch.distributed as dist

from megatron_gkd import platform

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Sizes of the parallel dimensions. The data-parallel size is what the world size leaves over."""

    tensor_model_parallel_size: int = 1
    """Ranks that split each layer's weights (and the vocabulary of the logits)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage (interleaved 1F1B); needs ``pipeline_model_parallel_size > 1``."""
    context_parallel_size: int = 1
    """Ranks that split the sequence inside attention."""
    expert_model_parallel_size: int = 1
    """Ranks that split the routed experts of MoE layers."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallelism inside each expert; ``None`` means the same as ``tensor_model_parallel_size``."""
    sequence_parallel: bool = False
    """Split activations outside tensor-parallel regions along the sequence; needs TP > 1."""

    def __post_init__(self):
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            if not isinstance(vpp, int) or vpp < 1:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size must be a positive integer or None, got {vpp!r}"
                )
            if vpp > 1 and self.pipeline_model_parallel_size == 1:
                raise ValueError(
                    "virtual_pipeline_model_parallel_size > 1 needs pipeline_model_parallel_size > 1; "
                    "set pipeline_model_parallel_size or drop virtual_pipeline_model_parallel_size"
                )
        etp = self.expert_tensor_parallel_size
        if etp is not None and (not isinstance(etp, int) or etp < 1):
            raise ValueError(f"expert_tensor_parallel_size must be a positive integer or None, got {etp!r}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "sequence_parallel needs tensor_model_parallel_size > 1; set sequence_parallel: false"
            )

    def transformer_config_kwargs(self) -> dict:
        """The parallel fields of Megatron-Core's ``TransformerConfig`` for this layout.

        Every builder of a ``TransformerConfig`` takes these from here, so that layout-specific
        settings live in one place. ``batch_p2p_comm`` is off for an interleaved pipeline of two
        stages: there a rank's previous and next stage are the same rank, and the batched path posts
        its two sends (input gradient, output activation) in the opposite order of the peer's two
        receives, so the two same-shaped tensors are silently swapped. The unbatched path puts the two
        directions on different groups for exactly this case.
        """
        vpp = self.virtual_pipeline_model_parallel_size
        interleaved = vpp is not None and vpp > 1
        return dict(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=vpp if interleaved else None,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.resolved_expert_tensor_parallel_size,
            sequence_parallel=self.sequence_parallel,
            batch_p2p_comm=not (interleaved and self.pipeline_model_parallel_size == 2),
        )

    @property
    def resolved_expert_tensor_parallel_size(self) -> int:
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` ranks; raises with the fix if the sizes do not fit."""
        model_parallel = (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size "
                f"({self.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size}) x context_parallel_size "
                f"({self.context_parallel_size}) = {model_parallel}; launch a multiple of "
                f"{model_parallel} processes or reduce those sizes"
            )
        expert_parallel = (
            self.resolved_expert_tensor_parallel_size
            * self.expert_model_parallel_size
            * self.pipeline_model_parallel_size
        )
        if world_size % expert_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by expert_tensor_parallel_size "
                f"({self.resolved_expert_tensor_parallel_size}) x expert_model_parallel_size "
                f"({self.expert_model_parallel_size}) x pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size}) = {expert_parallel}; reduce "
                "expert_model_parallel_size or launch more processes"
            )
        return world_size // model_parallel


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelState:
    """The process groups and this rank's coordinates, returned by :func:`initialize`.

    ``groups`` is Megatron-Core's ``ProcessGroupCollection`` (``groups.tp``, ``groups.pp``,
    ``groups.dp``, ``groups.ep``, ``groups.expt_tp`` ...), the object Megatron's own modules accept. Code
    outside ``parallel/`` takes every group and coordinate from a state it was given, never from Megatron's
    getters nor from :func:`get_state` (lint tests keep it so).
    """

    config: ParallelConfig
    world_size: int
    rank: int
    data_parallel_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    groups: object
    dp_gloo_group: dist.ProcessGroup | None = None
    """The data-parallel group on gloo (host tensors: batch shapes, agreement) whatever the device."""
    control_group: dist.ProcessGroup | None = None
    """Every rank on gloo: the trainer's control messages (agreement on failures, batches, metrics, service
    addresses, the preemption flag) travel in host memory whatever the device."""
    dp_cp_rank: int = 0
    """Rank in the data-and-context-parallel group (the replica index of dense weights)."""
    expert_dp_rank: int = 0
    """Rank in the expert-data-parallel group (the replica index of expert weights)."""
    etp_rank: int = 0
    """Rank in the expert-tensor-parallel group."""

    @property
    def tp_size(self) -> int:
        return self.config.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        return self.config.pipeline_model_parallel_size

    @property
    def ep_size(self) -> int:
        return self.config.expert_model_parallel_size

    @property
    def etp_size(self) -> int:
        return self.config.resolved_expert_tensor_parallel_size

    @property
    def mp_group(self) -> dist.ProcessGroup:
        """Tensor and pipeline ranks of one model replica."""
        return self.groups.mp

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.groups.ep

    @property
    def etp_group(self) -> dist.ProcessGroup:
        return self.groups.expt_tp

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.groups.tp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.groups.dp

    def is_first_stage(self, vp_stage: int | None = None) -> bool:
        """Whether model chunk ``vp_stage`` of this rank holds the embedding (Megatron's ``pre_process``)."""
        return self.pp_rank == 0 and not vp_stage

    def is_last_stage(self, vp_stage: int | None = None) -> bool:
        """Whether model chunk ``vp_stage`` of this rank holds the output layer (Megatron's ``post_process``)."""
        vpp = self.config.virtual_pipeline_model_parallel_size or 1
        return self.is_pipeline_last_stage and (vp_stage is None or vpp == 1 or vp_stage == vpp - 1)

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.config.pipeline_model_parallel_size - 1


_state: ParallelState | None = None

RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""What torchrun's own environment needs for ``--max-restarts`` to work. By default (torch 2.4 to at least 2.13)
the ranks of every attempt share the rendezvous's one TCP store, which still holds the dead attempt's keys: a
restarted rank reads a dead peer's address and the default group fails to connect (pytorch/pytorch#135712; seen
here as gloo's "connectFullMesh failed ... Connection refused"). With it, every attempt gets a store of its own."""


def check_restartable(environ=os.environ) -> None:
    """Refuses torchrun restarts (``--max-restarts`` > 0) that would restart into the dead attempt's store.

    Raises:
        ValueError: restarts are on and torchrun shares its rendezvous store with the ranks.
    """
    restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        setting = " ".join(f"{key}={value}" for key, value in RESTART_ENV.items())
        raise ValueError(f"torchrun --max-restarts={restarts} restarts the ranks into the rendezvous store the failed "
                         f"attempt used, where they read dead peers' addresses (pytorch/pytorch#135712): run torchrun "
                         f"with {setting} in its environment (the launcher sets it), or --max-restarts=0")


def _init_default_group() -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "torch.distributed is not initialised and RANK/WORLD_SIZE are not set; launch with "
            "torchrun (e.g. torchrun --nproc_per_node 2 ...) or initialise the default group first"
        )
    check_restartable()
    platform.set_local_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=platform.dist_backend())


def initialize(config: ParallelConfig | None = None, **sizes) -> ParallelState:
    """Builds Megatron-Core's model-parallel groups for ``config`` (or the sizes given as keywords).

    Initialises the default process group from the torchrun environment if needed. Requires
    :func:`megatron_gkd.platform.setup` to have run.

    Raises:
        ValueError: the sizes are invalid or do not fit the world size (the message names the fix).
        RuntimeError: the platform is not set up, or model parallelism is already initialised.
    """
    global _state
    platform.current()
    if config is None:
        config = ParallelConfig(**sizes)
    elif sizes:
        raise ValueError("pass either a ParallelConfig or sizes as keywords, not both")
    if _state is not None:
        raise RuntimeError("model parallelism is already initialised; call parallel.destroy() first")
    _init_default_group()
    world_size = dist.get_world_size()
    data_parallel_size = config.data_parallel_size(world_size)

    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    vpp = config.virtual_pipeline_model_parallel_size
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        expert_tensor_parallel_size=config.resolved_expert_tensor_parallel_size,
        create_gloo_process_groups=True,
    )
    groups = ProcessGroupCollection.use_mpu_process_groups()
    _state = ParallelState(
        config=config,
        world_size=world_size,
        rank=dist.get_rank(),
        data_parallel_size=data_parallel_size,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        groups=groups,
        dp_gloo_group=mpu.get_data_parallel_group_gloo(),
        dp_cp_rank=mpu.get_data_parallel_rank(with_context_parallel=True),
        expert_dp_rank=mpu.get_expert_data_parallel_rank(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        # After Megatron's groups, on every rank (building a group is collective, in the same order everywhere).
        control_group=dist.new_group(backend="gloo"),
    )
    logger.info(
        "model parallel: tp=%d pp=%d vpp=%s cp=%d ep=%d etp=%d dp=%d (world %d)",
        config.tensor_model_parallel_size,
        config.pipeline_model_parallel_size,
        vpp,
        config.context_parallel_size,
        config.expert_model_parallel_size,
        config.resolved_expert_tensor_parallel_size,
        data_parallel_size,
        world_size,
    )
    return _state


def get_state() -> ParallelState:
    """The state built by :func:`initialize` in this process: for entry points, which hand it down (library code
    takes it as an argument)."""
    if _state is None:
        raise RuntimeError("model parallelism is not initialised; call parallel.initialize(...) first")
    return _state


def destroy() -> None:
    """Destroys Megatron-Core's model-parallel groups (the default group is left to its owner)."""
    global _state
    if _state is None:
        return
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    _state = None


def seed(value: int) -> None:
    """Seeds the host/accelerator generators and Megatron's model-parallel RNG tracker."""
    from megatron.core import tensor_parallel

    platform.manual_seed(value)
    tensor_parallel.model_parallel_cuda_manual_seed(value)


__all__ = ["ParallelConfig", "ParallelState", "initialize", "destroy", "get_state", "seed"]

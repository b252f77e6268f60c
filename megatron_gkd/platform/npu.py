"""Ascend NPU: torch_npu and MindSpeed, imported before Megatron-Core, with the configured MindSpeed options.

MindSpeed (``mindspeed.megatron_adaptor``) patches Megatron-Core at import time (fused kernels, HCCL,
NPU device placement), so it must be imported before ``megatron.core``. Neither package can be installed
from the package index: torch_npu needs the CANN toolkit, and MindSpeed comes from Ascend's own source
(https://gitcode.com/Ascend/MindSpeed). See docs/ascend.md.

How MindSpeed receives its options (MindSpeed branch ``core_r0.16.0``: ``mindspeed/megatron_adaptor.py``,
``mindspeed/args_utils.py``, ``mindspeed/features_manager/``): importing the adaptor runs its
``patch_features()``, which reads the options once with ``get_mindspeed_args()``, an ``argparse`` parser
of every feature's flags applied with ``parse_known_args()`` to ``sys.argv`` (flags it does not register,
such as Megatron's ``--use-flash-attn``, are kept in the namespace too); the features whose flags are set
patch Megatron-Core, and MindSpeed's ``TransformerConfig.__init__`` wrapper copies the same namespace into
every ``TransformerConfig``. Megatron-Core used as a library has no ``megatron.training`` argument parsing,
so that command line is the interface: :func:`install` imports the adaptor with ``sys.argv`` set to the
program name and :meth:`MindSpeedConfig.to_argv`, then restores it. The trainer's own arguments never
reach MindSpeed's parser, and the configured options do, before Megatron-Core is imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys

logger = logging.getLogger(__name__)

MINDSPEED_ADAPTOR = "mindspeed.megatron_adaptor"

CONTEXT_PARALLEL_ALGOS = ("megatron_cp_algo", "ulysses_cp_algo", "hybrid_cp_algo", "adaptive_cp_algo",
                          "hybrid_adaptive_cp_algo")

# Boolean option -> the MindSpeed flags it passes. Each fused kernel also gets the Megatron flag that
# MindSpeed's documentation pairs it with (docs/zh/features/{rms_norm,swiglu,rotary-embedding}.md): those
# describe the model, and every architecture megatron-gkd builds uses RMSNorm, SwiGLU and RoPE. MindSpeed's
# fused-RoPE check reads ``position_embedding_type`` from the same namespace, which a library user must give.
_SWITCHES = {
    "use_flash_attn": ("--use-flash-attn",),
    "use_fused_rmsnorm": ("--use-fused-rmsnorm", "--normalization", "RMSNorm"),
    "use_fused_swiglu": ("--use-fused-swiglu", "--swiglu"),
    "use_fused_rotary_pos_emb": ("--use-fused-rotary-pos-emb", "--position-embedding-type", "rope"),
}


@dataclasses.dataclass(kw_only=True, slots=True)
class MindSpeedConfig:
    """MindSpeed's features on the ``npu`` platform, handed to MindSpeed as its command-line flags when
    ``platform.setup()`` imports it (before Megatron-Core). Inert on ``cuda`` and ``cpu``: a warning names
    the options set. The defaults pass no flag: MindSpeed then runs with its own defaults."""

    use_flash_attn: bool = False
    """Ascend's fused flash attention in Megatron-Core's ``DotProductAttention`` (``--use-flash-attn``)."""
    use_fused_rmsnorm: bool = False
    """Fused RMSNorm kernel (``--use-fused-rmsnorm``)."""
    use_fused_swiglu: bool = False
    """Fused SwiGLU kernel (``--use-fused-swiglu``)."""
    use_fused_rotary_pos_emb: bool = False
    """Fused rotary position embedding (``--use-fused-rotary-pos-emb``)."""
    context_parallel_algo: str = "megatron_cp_algo"
    """Context-parallel attention (``--context-parallel-algo``): ``megatron_cp_algo`` (ring attention),
    ``ulysses_cp_algo``, ``hybrid_cp_algo`` (Ulysses inside a ring: set ``ulysses_degree_in_cp``),
    ``adaptive_cp_algo`` or ``hybrid_adaptive_cp_algo``. Acts only with ``parallel.context_parallel_size > 1``.
    (MindSpeed's ``kvallgather_cp_algo`` needs Transformer Engine layer specs, which no NPU build has.)"""
    ulysses_degree_in_cp: int | None = None
    """``hybrid_cp_algo``: the Ulysses part of the context-parallel size (``--ulysses-degree-in-cp``)."""
    optimization_level: int = 2
    """MindSpeed's feature level (``--optimization-level``): 0 only makes Megatron-Core run on the NPU, 1
    adds Ascend-affine kernels, 2 (MindSpeed's default) also enables every feature whose flag is set."""
    extra_args: list[str] = dataclasses.field(default_factory=list)
    """Further MindSpeed flags, passed as written after those above, e.g. ``["--use-cp-send-recv-overlap"]``."""

    def __post_init__(self):
        if self.context_parallel_algo not in CONTEXT_PARALLEL_ALGOS:
            raise ValueError(f"mindspeed.context_parallel_algo={self.context_parallel_algo!r}; choose one of "
                             f"{list(CONTEXT_PARALLEL_ALGOS)}")
        if self.optimization_level not in (0, 1, 2):
            raise ValueError(f"mindspeed.optimization_level={self.optimization_level}; choose 0, 1 or 2")
        if self.ulysses_degree_in_cp is not None and self.ulysses_degree_in_cp < 1:
            raise ValueError(f"mindspeed.ulysses_degree_in_cp={self.ulysses_degree_in_cp} must be >= 1 (or null)")
        if self.context_parallel_algo == "hybrid_cp_algo" and self.ulysses_degree_in_cp is None:
            raise ValueError("mindspeed.context_parallel_algo=hybrid_cp_algo needs mindspeed.ulysses_degree_in_cp (the "
                             "Ulysses part of parallel.context_parallel_size); set it, or choose ulysses_cp_algo or "
                             "megatron_cp_algo")
        if self.extra_args and not str(self.extra_args[0]).startswith("--"):
            raise ValueError(f"mindspeed.extra_args must start with a flag (--name), got {self.extra_args[0]!r}")
        owned = {"--context-parallel-algo": "context_parallel_algo", "--ulysses-degree-in-cp": "ulysses_degree_in_cp",
                 "--optimization-level": "optimization_level"}
        owned.update({flags[0]: name for name, flags in _SWITCHES.items()})
        for arg in self.extra_args:
            flag = str(arg).split("=", 1)[0]
            if flag in owned:
                raise ValueError(f"mindspeed.extra_args sets {flag}, which mindspeed.{owned[flag]} owns; set "
                                 f"mindspeed.{owned[flag]} instead")

    def non_default(self) -> dict:
        """The options that differ from their defaults, as ``{"mindspeed.<name>": value}``."""
        default = MindSpeedConfig()
        return {f"mindspeed.{field.name}": getattr(self, field.name) for field in dataclasses.fields(self)
                if getattr(self, field.name) != getattr(default, field.name)}

    def to_argv(self) -> list[str]:
        """MindSpeed's command-line flags for these options (empty for the defaults)."""
        argv: list[str] = []
        for name, flags in _SWITCHES.items():
            if getattr(self, name):
                argv += flags
        default = MindSpeedConfig()
        if self.context_parallel_algo != default.context_parallel_algo:
            argv += ["--context-parallel-algo", self.context_parallel_algo]
        if self.ulysses_degree_in_cp is not None:
            argv += ["--ulysses-degree-in-cp", str(self.ulysses_degree_in_cp)]
        if self.optimization_level != default.optimization_level:
            argv += ["--optimization-level", str(self.optimization_level)]
        return argv + [str(arg) for arg in self.extra_args]


def install(options: MindSpeedConfig | None = None) -> None:
    """Imports torch_npu, then MindSpeed's Megatron adaptor with ``options`` on its command line.

    Raises:
        RuntimeError: torch_npu or MindSpeed is missing (the message says what to install), MindSpeed
            was imported before with options it cannot receive now, or MindSpeed rejected the options.
    """
    options = options or MindSpeedConfig()
    try:
        importlib.import_module("torch_npu")
    except ImportError as error:
        raise RuntimeError(
            "the npu platform needs torch_npu (with the Ascend CANN toolkit); install the torch_npu "
            "release matching your torch, or choose another platform with MEGATRON_GKD_PLATFORM"
        ) from error
    flags = options.to_argv()
    if MINDSPEED_ADAPTOR in sys.modules and flags:
        raise RuntimeError(
            f"{MINDSPEED_ADAPTOR} was imported before megatron_gkd.platform.setup(), so it has read its options "
            f"already and cannot receive the configured ones ({' '.join(flags)}); let platform.setup() import it"
        )
    program = sys.argv[0] if sys.argv else "megatron_gkd"
    saved, sys.argv = sys.argv, [program, *flags]
    try:
        importlib.import_module(MINDSPEED_ADAPTOR)
    except ImportError as error:
        raise RuntimeError(
            "the npu platform needs MindSpeed from Ascend's source "
            "(git clone https://gitcode.com/Ascend/MindSpeed && pip install -e MindSpeed); the "
            "'mindspeed' package on the public index is a placeholder"
        ) from error
    except SystemExit as error:  # argparse's exit on a flag it rejects (its message is on stderr)
        raise RuntimeError(f"MindSpeed rejected its options {flags} (exit {error.code}); check the mindspeed.* "
                           "config section against the installed MindSpeed's flags") from None
    finally:
        sys.argv = saved
    logger.info("npu platform: torch_npu and %s imported before Megatron-Core; MindSpeed options: %s",
                MINDSPEED_ADAPTOR, " ".join(flags) or "its defaults")

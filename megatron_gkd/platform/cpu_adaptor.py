"""The CPU adaptor: makes Megatron-Core 0.16.1 run on the host under gloo.

Megatron-Core is written for CUDA. :func:`install` registers an import hook *before* Megatron-Core is
imported; as each ``megatron.core`` module finishes loading, the hook applies the patches below that
target it. Each patch is named, says what upstream does and why the replacement is safe, and is
covered by ``tests/unit/platform/test_cpu_adaptor.py``. The guiding rule: a patch only redirects code
that would *raise* on a CPU-only torch build, or asserts a CUDA tensor type; it never changes what a
working call computes.

The adaptor is verified against exactly :data:`MEGATRON_CORE_VERSION`; another version is refused
with a message, because the source rewrites check literal text of that release.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.metadata
import logging
import sys
import warnings
from types import ModuleType
from typing import Callable

import torch

from megatron_gkd.platform.host_cuda import HOST_DEVICE
from megatron_gkd.platform.source_patch import SourceRewrite
from megatron_gkd.platform.torch_view import TORCH_VIEW

logger = logging.getLogger(__name__)

MEGATRON_CORE_VERSION = "0.16.1"
_MEGATRON_PREFIX = "megatron.core"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One named change to Megatron-Core (or torch) made by the CPU adaptor.

    Attributes:
        name: short identifier, used in logs and tests.
        target: a module name (patched when it loads), ``"megatron.core.*"`` for every Megatron-Core
            module, or ``"global"`` (applied once at install time).
        upstream: what upstream does.
        why_safe: why the replacement computes the same thing on the host.
        apply: the function that patches; receives the module (``None`` for global patches).
    """

    name: str
    target: str
    upstream: str
    why_safe: str
    apply: Callable[[ModuleType | None], None]


def _use_torch_view(module: ModuleType) -> None:
    if module.__dict__.get("torch") is torch:
        module.torch = TORCH_VIEW


def _tensor_cuda_on_host(self: torch.Tensor, device=None, non_blocking=False, **kwargs):
    return self


def _patch_tensor_cuda(_: ModuleType | None) -> None:
    torch.Tensor.cuda = _tensor_cuda_on_host


def _host_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _host_set_rng_state(new_state: torch.Tensor, device=-1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _patch_rng(module: ModuleType) -> None:
    module._get_cuda_rng_state = _host_get_rng_state
    module._set_cuda_rng_state = _host_set_rng_state


def _define_missing_te_gemm(module: ModuleType) -> None:
    if not hasattr(module, "te_general_gemm"):
        module.te_general_gemm = None


def _no_transformer_engine_in_mla(module: ModuleType) -> None:
    module.HAVE_TE = False


def _host_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """Megatron's ``local_multi_tensor_scale`` (``dst.copy_(src * scale)``), in place where ``src`` is ``dst``."""
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        if src is dst:
            dst.mul_(scale)
        else:
            dst.copy_(src * scale)


def _scale_gradients_in_place(module: ModuleType) -> None:
    if getattr(module, "multi_tensor_scale_impl", None) is getattr(module, "local_multi_tensor_scale", object()):
        module.multi_tensor_scale_impl = _host_multi_tensor_scale


def _rewrite(*rewrites: SourceRewrite) -> Callable[[ModuleType], None]:
    def apply(module: ModuleType) -> None:
        for rewrite in rewrites:
            rewrite.apply(module)

    return apply


# The CUDA tensor type strings, mapped to their host names.
_TYPE_STRINGS = (
    ("'torch.cuda.FloatTensor'", "'torch.FloatTensor'"),
    ("'torch.cuda.HalfTensor'", "'torch.HalfTensor'"),
    ("'torch.cuda.BFloat16Tensor'", "'torch.BFloat16Tensor'"),
)

_SEQUENCE_PARALLEL_NORM = (
    ('assert not config.sequence_parallel, f"sequence parallel not supported by torch LayerNorm"', ""),
    (
        "return norm_cls(normalized_shape=hidden_size, eps=eps)",
        # The source is dedented: the method body sits at four spaces.
        "norm = norm_cls(normalized_shape=hidden_size, eps=eps)\n"
        "    for param in norm.parameters():\n"
        "        param.sequence_parallel = config.sequence_parallel\n"
        "    return norm",
    ),
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="torch_view",
        target=f"{_MEGATRON_PREFIX}.*",
        upstream="calls torch.cuda.current_device()/Stream/Event/get_rng_state and creates tensors "
        "with device='cuda' or pin_memory=True throughout",
        why_safe="only Megatron-Core's modules see the view; every redirected call would raise on a "
        "CPU-only build, and the host equivalent computes the same values",
        apply=_use_torch_view,
    ),
    Patch(
        name="tensor_cuda_method",
        target="global",
        upstream="moves tensors with tensor.cuda() (broadcast_data, tied embeddings, optimizer and "
        "checkpoint loading)",
        why_safe="on a CPU-only build .cuda() always raises; the host is the only device, and a "
        "tensor already on the target device is returned as is, as CUDA does",
        apply=_patch_tensor_cuda,
    ),
    Patch(
        name="host_rng_state",
        target=f"{_MEGATRON_PREFIX}.tensor_parallel.random",
        upstream="the RNG tracker reads and sets CUDA generator states; setting goes through "
        "torch.cuda._lazy_call, which on a CPU-only build queues the call forever (a silent no-op)",
        why_safe="the tracker forks the host generator instead; fork() still saves and restores the "
        "surrounding state, so tensor-parallel regions get their own reproducible stream",
        apply=_patch_rng,
    ),
    Patch(
        name="missing_te_general_gemm",
        target=f"{_MEGATRON_PREFIX}.transformer.moe.moe_utils",
        upstream="references te_general_gemm, defined only when Transformer Engine imports "
        "(NameError without it in 0.16.1)",
        why_safe="None is what the code checks for and selects the torch.mm path",
        apply=_define_missing_te_gemm,
    ),
    Patch(
        name="sequence_parallel_torch_norm",
        target=f"{_MEGATRON_PREFIX}.transformer.torch_norm",
        upstream="the torch LayerNorm/RMSNorm fallback (used without apex/TE) asserts that sequence "
        "parallelism is off, because it does not mark its weights for the tensor-parallel gradient "
        "all-reduce that sequence parallelism needs",
        why_safe="the weights are marked sequence_parallel, as TE's and apex's norms mark them, so "
        "finalize_model_grads sums their partial gradients over the tensor-parallel group; the norm "
        "itself is the same torch module",
        apply=_rewrite(SourceRewrite("WrappedTorchNorm.__new__", _SEQUENCE_PARALLEL_NORM)),
    ),
    Patch(
        name="mla_have_te",
        target=f"{_MEGATRON_PREFIX}.transformer.multi_latent_attention",
        upstream="sets HAVE_TE = True whenever megatron.core.extensions.transformer_engine imports, "
        "which it does without Transformer Engine (its classes are then mocks), so MLA's constructor "
        "raises TypeError on isinstance(self.linear_proj, TELinear)",
        why_safe="the adaptor installs it only where Transformer Engine does not import (the host, or a GPU "
        "without it); False is the value the probe means to compute, and it only guards TE fp8/fp4 options",
        apply=_no_transformer_engine_in_mla,
    ),
    Patch(
        name="clip_grads_type_check",
        target=f"{_MEGATRON_PREFIX}.optimizer.clip_grads",
        upstream="asserts param.grad.type() == 'torch.cuda.FloatTensor' before scaling gradients",
        why_safe="the same check against the host type name",
        apply=_rewrite(SourceRewrite("clip_grad_by_total_norm_fp32", _TYPE_STRINGS[:1])),
    ),
    Patch(
        name="clip_grads_in_place",
        target=f"{_MEGATRON_PREFIX}.optimizer.clip_grads",
        upstream="without Transformer Engine or apex, gradient clipping scales each gradient with "
        "local_multi_tensor_scale, dst.copy_(src * scale) with src and dst the same tensor: a temporary as "
        "large as the largest gradient (the word embedding's, 0.58 GiB at 152k x 1024 in fp32) at the end of "
        "every clipped step, the rank's peak at the 0.6B shape",
        why_safe="where src is dst the product is written in place (dst.mul_(scale)): the same multiplication "
        "by the same scalar, element by element, so the same bits; any other pair keeps upstream's copy",
        apply=_scale_gradients_in_place,
    ),
    Patch(
        name="optimizer_type_checks",
        target=f"{_MEGATRON_PREFIX}.optimizer.optimizer",
        upstream="the fp16/bf16 optimizer sorts parameters by CUDA type strings and rejects others",
        why_safe="the same sorting against the host type names",
        apply=_rewrite(SourceRewrite("Float16OptimizerWithFloat16Params.__init__", _TYPE_STRINGS)),
    ),
    Patch(
        name="distrib_optimizer_type_checks",
        target=f"{_MEGATRON_PREFIX}.optimizer.distrib_optimizer",
        upstream="the distributed optimizer sorts parameters by CUDA type strings and rejects others",
        why_safe="the same sorting against the host type names",
        apply=_rewrite(
            SourceRewrite("DistributedOptimizer._build_model_and_main_param_groups", _TYPE_STRINGS),
            SourceRewrite("DistributedOptimizer.__init__", _TYPE_STRINGS[1:]),
        ),
    ),
)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, on_loaded: Callable[[ModuleType], None]):
        self._loader = loader
        self._on_loaded = on_loaded

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._on_loaded(module)

    def __getattr__(self, name):  # get_source, get_filename, is_package ...
        return getattr(self._loader, name)


class _MegatronImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loader of every ``megatron.core`` module so patches run right after it loads."""

    def __init__(self, on_loaded: Callable[[ModuleType], None]):
        self._on_loaded = on_loaded

    def find_spec(self, fullname, path, target=None):
        if fullname != _MEGATRON_PREFIX and not fullname.startswith(_MEGATRON_PREFIX + "."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, self._on_loaded)
                return spec
        return None


_APPLIED: list[str] = []


def applied_patches() -> tuple[str, ...]:
    """Names of the patches applied so far, in order (one entry per module for per-module patches)."""
    return tuple(_APPLIED)


# The patches that Megatron-Core needs wherever Transformer Engine does not import: on the host, and on a
# GPU without it (seen on an H200: the MoE router raised NameError on te_general_gemm).
WITHOUT_TRANSFORMER_ENGINE = ("missing_te_general_gemm", "sequence_parallel_torch_norm", "mla_have_te")


def _on_megatron_module_loaded(patches: tuple[Patch, ...], module: ModuleType) -> None:
    for patch in patches:
        if patch.target == f"{_MEGATRON_PREFIX}.*" or patch.target == module.__name__:
            patch.apply(module)
            if patch.target == module.__name__:
                _APPLIED.append(patch.name)
                logger.debug("CPU adaptor: applied %s to %s", patch.name, module.__name__)


def check_megatron_version() -> str:
    """Returns the installed Megatron-Core version, raising if it is not the verified one."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError as error:
        raise RuntimeError(
            f"megatron-core is not installed; install megatron-core=={MEGATRON_CORE_VERSION}"
        ) from error
    if version != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"the CPU adaptor was verified against megatron-core=={MEGATRON_CORE_VERSION}, but "
            f"{version} is installed; install megatron-core=={MEGATRON_CORE_VERSION}, or re-verify the "
            "adaptor's patches (megatron_gkd/platform/cpu_adaptor.py) against the new release"
        )
    return version


# Megatron-Core warns at import that it falls back to torch kernels; on the host that is the design. Its
# tensor-parallel layers advise CUDA_DEVICE_MAX_CONNECTIONS=1 (a CUDA stream setting): nothing to set here.
_EXPECTED_FALLBACK_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    "When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
)


def install(only: tuple[str, ...] | None = None) -> None:
    """Installs the import hook and the global patches. Megatron-Core must not be imported yet.

    Args:
        only: names of the patches to install; default: every one (the host). A GPU without Transformer
            Engine installs :data:`WITHOUT_TRANSFORMER_ENGINE`.
    """
    check_megatron_version()
    patches = PATCHES if only is None else tuple(patch for patch in PATCHES if patch.name in only)
    if only is None:
        for message in _EXPECTED_FALLBACK_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        logger.info("CPU adaptor: Megatron-Core will use its torch fallbacks (no Transformer Engine, no apex)")
    else:
        logger.info("Megatron-Core adaptor: %s", ", ".join(patch.name for patch in patches))
    sys.meta_path.insert(0, _MegatronImportHook(functools.partial(_on_megatron_module_loaded, patches)))
    for patch in patches:
        if patch.target == "global":
            patch.apply(None)
            _APPLIED.append(patch.name)
    logger.debug("CPU adaptor installed; Megatron-Core will run on %s", HOST_DEVICE)

"""Where the code runs: ``cuda``, ``npu`` or ``cpu``, decided once, before Megatron-Core is imported.

Nothing outside this package names a device. Typical use, first thing in an entry point::

    from megatron_gkd import platform
    platform.setup()            # or setup("cpu"); env MEGATRON_GKD_PLATFORM overrides detection
    device = platform.device()  # torch.device for this rank's tensors
    backend = platform.dist_backend()

* ``cuda``: NCCL; Transformer Engine specs are used by the model providers when TE imports.
* ``npu``: HCCL; ``torch_npu`` and ``mindspeed.megatron_adaptor`` are imported before Megatron-Core
  (MindSpeed patches Megatron at import time, so the order matters), with the config's ``mindspeed``
  options (:class:`~megatron_gkd.platform.npu.MindSpeedConfig`) on MindSpeed's command line.
* ``cpu``: gloo; the CPU adaptor (:mod:`megatron_gkd.platform.cpu_adaptor`) makes Megatron-Core's
  CUDA-only calls run on the host.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import sys

import torch

from megatron_gkd.platform import cpu_adaptor, npu
from megatron_gkd.platform.npu import MindSpeedConfig

logger = logging.getLogger(__name__)

PLATFORM_ENV = "MEGATRON_GKD_PLATFORM"
PLATFORM_NAMES = ("cuda", "npu", "cpu")


@dataclasses.dataclass(frozen=True, slots=True)
class Platform:
    """A resolved platform.

    Attributes:
        name: ``cuda``, ``npu`` or ``cpu``.
        device_type: the torch device type of this platform's tensors.
        dist_backend: the ``torch.distributed`` backend for model-parallel groups.
    """

    name: str
    device_type: str
    dist_backend: str


_PLATFORMS = {
    "cuda": Platform("cuda", "cuda", "nccl"),
    "npu": Platform("npu", "npu", "hccl"),
    "cpu": Platform("cpu", "cpu", "gloo"),
}

_current: Platform | None = None
_mindspeed: MindSpeedConfig | None = None  # the options MindSpeed was imported with (npu)


def _npu_available() -> bool:
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError:
        return False
    return bool(getattr(torch_npu, "npu", None) and torch_npu.npu.is_available())


def detect() -> str:
    """Returns the platform name: the ``MEGATRON_GKD_PLATFORM`` variable if set, else what is present."""
    requested = os.environ.get(PLATFORM_ENV, "").strip().lower()
    if requested:
        if requested not in PLATFORM_NAMES:
            raise ValueError(
                f"{PLATFORM_ENV}={requested!r} is not a platform; use one of {', '.join(PLATFORM_NAMES)}"
            )
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    return "cpu"


def _megatron_already_imported() -> bool:
    return any(name == "megatron.core" or name.startswith("megatron.core.") for name in sys.modules)


def setup(name: str | None = None, *, mindspeed: MindSpeedConfig | None = None) -> Platform:
    """Resolves the platform and prepares the process for Megatron-Core. Call it before importing Megatron.

    Calling it again with the same (or no) name is harmless and returns the same platform.

    Args:
        name: ``cuda``, ``npu`` or ``cpu``; ``None`` means :func:`detect`.
        mindspeed: MindSpeed's options (the config's ``mindspeed`` section), passed to MindSpeed as it is
            imported on ``npu``; set on another platform they are inert and a warning names them.

    Raises:
        ValueError: ``name`` is unknown, or differs from the platform already set up, or ``mindspeed``
            differs from the options MindSpeed was already imported with.
        RuntimeError: Megatron-Core was imported before the first call on a platform that adapts it.
    """
    global _current, _mindspeed
    if name is not None and name not in PLATFORM_NAMES:
        raise ValueError(f"platform {name!r} is not one of {', '.join(PLATFORM_NAMES)}")
    if _current is not None:
        if name is not None and name != _current.name:
            raise ValueError(
                f"platform already set up as {_current.name!r}; it cannot change to {name!r} in one process"
            )
        if mindspeed is not None and _current.name == "npu" and mindspeed != _mindspeed:
            raise ValueError("MindSpeed was imported with other options; they are read once, when it is imported "
                             "by the first platform.setup() of the process: pass the mindspeed options there")
        _warn_inert(_current, mindspeed)
        return _current
    resolved = _PLATFORMS[name or detect()]
    if resolved.name in ("cpu", "npu") and _megatron_already_imported():
        raise RuntimeError(
            "megatron.core was imported before megatron_gkd.platform.setup(); on the "
            f"{resolved.name} platform Megatron-Core must be adapted as it is imported. Call "
            "platform.setup() first thing in the entry point, before any import of megatron.core"
        )
    if resolved.name == "cpu":
        cpu_adaptor.install()
    elif resolved.name == "cuda" and importlib.util.find_spec("transformer_engine") is None:
        # Megatron-Core's fallbacks without Transformer Engine have bugs of their own (the MoE router's
        # te_general_gemm NameError): the CPU adaptor's patches for those, and none of its host redirects.
        if _megatron_already_imported():
            logger.warning("megatron.core was imported before platform.setup(): without Transformer Engine "
                           "its MoE router fails on CUDA (te_general_gemm); call setup() first")
        else:
            cpu_adaptor.install(only=cpu_adaptor.WITHOUT_TRANSFORMER_ENGINE)
    elif resolved.name == "npu":
        npu.install(mindspeed)
        _mindspeed = mindspeed or MindSpeedConfig()
    _warn_inert(resolved, mindspeed)
    _current = resolved
    logger.info("platform: %s (distributed backend %s)", resolved.name, resolved.dist_backend)
    return resolved


def _warn_inert(platform: Platform, mindspeed: MindSpeedConfig | None) -> None:
    options = mindspeed.non_default() if mindspeed is not None and platform.name != "npu" else {}
    if options:
        logger.warning("%s: MindSpeed runs only on the npu platform; on %s these options have no effect",
                       ", ".join(f"{key}={value!r}" for key, value in options.items()), platform.name)


def current() -> Platform:
    """Returns the platform set up by :func:`setup`.

    Raises:
        RuntimeError: :func:`setup` has not been called in this process.
    """
    if _current is None:
        raise RuntimeError(
            "megatron_gkd.platform.setup() has not been called; call it first thing in the entry "
            "point, before Megatron-Core is imported or any model/parallel state is built"
        )
    return _current


def known_platforms() -> tuple[Platform, ...]:
    """Every platform this package can set up, in :data:`PLATFORM_NAMES` order."""
    return tuple(_PLATFORMS[name] for name in PLATFORM_NAMES)


def is_set_up() -> bool:
    return _current is not None


def device() -> torch.device:
    """The device of this process's tensors (the local accelerator, or the host)."""
    platform = current()
    if platform.name == "cpu":
        return torch.device("cpu")
    accelerator = getattr(torch, platform.device_type)
    return torch.device(platform.device_type, accelerator.current_device())


def dist_backend() -> str:
    return current().dist_backend


def _gloo_group(store, rank, size, timeout):
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _nccl_group(store, rank, size, timeout):
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _hccl_group(store, rank, size, timeout):
    import torch.distributed as dist

    # torch_npu adds ProcessGroupHCCL to torch.distributed when it is imported (platform "npu").
    return dist.ProcessGroupHCCL(store, rank, size, timeout)


PROCESS_GROUP_BUILDERS = {"gloo": _gloo_group, "nccl": _nccl_group, "hccl": _hccl_group}
"""Backend name -> ``f(store, rank, size, timeout)``."""


def new_process_group(backend: str, store, rank: int, size: int, timeout, *, bind_address: str | None = None):
    """A process group on its own ``store``, outside the default group (for example between a
    trainer's torchrun world and rollout processes that are not part of it).

    Args:
        bind_address: gloo only: the local address its sockets listen on (default: gloo's choice, the
            address the host name resolves to). NCCL and HCCL pick their interface from their own
            environment (``NCCL_SOCKET_IFNAME``, ``HCCL_SOCKET_IFNAME``).

    Raises:
        ValueError: ``backend`` has no builder in :data:`PROCESS_GROUP_BUILDERS`.
    """
    if backend == "gloo" and bind_address is not None:
        import torch.distributed as dist

        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_address)]
        return dist.ProcessGroupGloo(store, rank, size, options)
    if backend not in PROCESS_GROUP_BUILDERS:
        raise ValueError(f"process-group backend {backend!r} is not supported; choose one of "
                         f"{sorted(PROCESS_GROUP_BUILDERS)} (or add its builder to platform.PROCESS_GROUP_BUILDERS)")
    return PROCESS_GROUP_BUILDERS[backend](store, rank, size, timeout)


def set_local_device(local_rank: int) -> None:
    """Binds this process to its local accelerator (no-op on the host)."""
    platform = current()
    if platform.name != "cpu":
        getattr(torch, platform.device_type).set_device(local_rank)


def synchronize() -> None:
    """Waits for queued device work (for timers); no-op on the host."""
    platform = current()
    if platform.name != "cpu":
        getattr(torch, platform.device_type).synchronize()


def _accelerator():
    """The torch module of this platform's device (``torch.cuda``, ``torch.npu``), ``None`` on the host."""
    platform = current()
    return None if platform.name == "cpu" else getattr(torch, platform.device_type)


def memory_allocated() -> int:
    """Bytes of device memory held by live tensors (0 on the host, where the allocator keeps no count)."""
    accelerator = _accelerator()
    return 0 if accelerator is None else accelerator.memory_allocated()


def max_memory_allocated(reset: bool = False) -> int:
    """The peak of :func:`memory_allocated` since the last reset (0 on the host: use RSS there); ``reset``
    starts a new one."""
    accelerator = _accelerator()
    if accelerator is None:
        return 0
    if reset:
        accelerator.reset_peak_memory_stats()
    return accelerator.max_memory_allocated()


MALLOC_ARENAS = 2
"""glibc malloc arenas of a server process (:func:`limit_malloc_arenas`)."""


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Caps this process's glibc malloc arenas at ``arenas``, as ``MALLOC_ARENA_MAX`` would, unless the environment
    sets that itself; returns whether the cap was set (False off glibc).

    glibc gives each thread that allocates its own arena, up to 8 per core, and memory freed in one arena is not
    reused by another: a server whose request threads allocate and free large buffers keeps the freed memory of each.
    The served teacher at 0.6b peaked 0.5 GiB lower with 2 arenas (docs/performance.md); a training rank did not change.
    Call it first thing, before the threads start.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    import ctypes
    import ctypes.util

    try:
        mallopt = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallopt", None)
    except OSError:
        return False
    if mallopt is None:
        return False
    m_arena_max = -8  # glibc's malloc.h
    return mallopt(m_arena_max, arenas) == 1


def peak_rss_gib() -> float:
    """This process's peak resident set on the host, GiB (libraries, engines and allocator caches included)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def describe() -> dict[str, str]:
    """Versions and device of this process, for benchmark reports: torch, the device runtime, the device
    name and the collectives library (each ``"-"`` where there is none)."""
    found = {"platform": current().name, "torch": torch.__version__, "runtime": "-", "device": "-", "collectives": "-"}
    if current().name == "cuda":
        found.update(runtime=f"CUDA {torch.version.cuda}", device=torch.cuda.get_device_name(),
                     collectives="NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
    elif current().name == "npu":
        found.update(device=torch.npu.get_device_name())
    return found


def use_deterministic_algorithms() -> None:
    """Turns on torch's deterministic algorithms, with what the platform needs for them.

    On CUDA, cuBLAS is deterministic only with a fixed workspace: torch raises at the first matrix product
    unless ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:8`` or ``:16:8``, so it is set here (before the first
    product creates cuBLAS's handle) when the user has not chosen one.
    """
    if current().name == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def manual_seed(seed: int) -> None:
    """Seeds the host generator and, where there is one, the accelerator's."""
    torch.manual_seed(seed)
    platform = current()
    if platform.name != "cpu":
        getattr(torch, platform.device_type).manual_seed_all(seed)


def accelerator_rng_state() -> torch.Tensor | None:
    """The accelerator generator's state (for checkpoints); ``None`` on the host, whose generator is
    ``torch.get_rng_state()``."""
    platform = current()
    if platform.name == "cpu":
        return None
    return getattr(torch, platform.device_type).get_rng_state()


def set_accelerator_rng_state(state: torch.Tensor | None) -> None:
    """Restores a state from :func:`accelerator_rng_state` (``None``: nothing to restore)."""
    platform = current()
    if state is not None and platform.name != "cpu":
        getattr(torch, platform.device_type).set_rng_state(state)


def empty_cache() -> None:
    """Returns the accelerator allocator's cached blocks to the device; no-op on the host."""
    platform = current()
    if platform.name != "cpu":
        getattr(torch, platform.device_type).empty_cache()


def _reset_for_tests() -> None:
    """Forgets the platform choice (tests only; the adaptor's import hook stays installed)."""
    global _current, _mindspeed
    _current = _mindspeed = None

"""Run a function in N freshly spawned processes joined by a ``torch.distributed`` group.

Used by the distributed tests and the benchmarks::

    results = run_distributed(body, world_size=2, args=(3,))   # body(3) runs on ranks 0 and 1

In each child the platform is set up *before* the function's module is imported (the function travels
by name, not pickled), so a test module may import Megatron-Core at the top. The default process group
is initialised with the platform's backend (gloo on the host). The parent returns the per-rank return
values, or raises :class:`DistributedFailure` carrying the traceback of the first rank that failed, or
a timeout naming the ranks that did not finish; leftover processes are killed either way.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import queue as queue_lib
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp

from megatron_gkd import platform
from megatron_gkd.child_process import free_port  # noqa: F401 - tests take ports from here


class DistributedFailure(RuntimeError):
    """A rank raised; the message holds that rank's traceback."""


def _resolve(module_name: str, qualname: str) -> Callable:
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _child(
    rank: int,
    world_size: int,
    port: int,
    target: tuple[str, str],
    args: tuple,
    kwargs: dict,
    results: "mp.Queue",
    platform_name: str | None,
    num_threads: int,
    init_process_group: bool,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(num_threads)
    try:
        resolved = platform.setup(platform_name)
        if init_process_group:
            platform.set_local_device(rank)
            torch.distributed.init_process_group(
                backend=resolved.dist_backend,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=120),
            )
        value = _resolve(*target)(*args, **kwargs)
        # Pickled to bytes here: torch's queue reducers would share tensors through file descriptors
        # that vanish when this process exits before the parent reads them.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - the traceback goes to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        # Only the group made here: one that the function's own code made (vLLM makes one in a process
        # without a world) is its owner's to destroy, and destroying it under vLLM made vLLM's
        # teardown at exit raise "Invalid process group specified".
        if init_process_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_distributed(
    fn: Callable,
    world_size: int,
    *,
    args: Sequence = (),
    kwargs: dict | None = None,
    timeout: float = 300.0,
    platform_name: str | None = "cpu",
    num_threads: int = 1,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
) -> list:
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks and returns their results by rank.

    Args:
        fn: a module-level function (it is imported by name in each child).
        world_size: number of processes.
        args, kwargs: passed to ``fn``; must be picklable, as must its return value.
        timeout: seconds for the whole run before every rank is killed.
        platform_name: platform to set up in the children (``None``: detect).
        num_threads: torch intra-op threads per rank (1 keeps N ranks from oversubscribing cores).
        init_process_group: initialise the default group with the platform's backend.
        env: extra environment variables for the children.

    Raises:
        DistributedFailure: a rank raised, or ranks did not finish within ``timeout``.
    """
    target = (fn.__module__, fn.__qualname__)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = []
    for rank in range(world_size):
        process = context.Process(
            target=_child,
            args=(
                rank,
                world_size,
                port,
                target,
                tuple(args),
                dict(kwargs or {}),
                results,
                platform_name,
                num_threads,
                init_process_group,
                dict(env or {}),
            ),
            daemon=True,
        )
        process.start()
        processes.append(process)

    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise DistributedFailure(
                    f"{fn.__qualname__}: ranks {missing} did not finish within {timeout:.0f} s"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue_lib.Empty:
                dead = [r for r, p in enumerate(processes) if not p.is_alive() and r not in values]
                if dead and all(p.exitcode not in (None, 0) for r, p in enumerate(processes) if r in dead):
                    raise DistributedFailure(
                        f"{fn.__qualname__}: ranks {dead} died without reporting "
                        f"(exit codes {[processes[r].exitcode for r in dead]})"
                    ) from None
                continue
            if not ok:
                raise DistributedFailure(f"{fn.__qualname__} failed on rank {rank}:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for process in processes:
            process.join(timeout=5 if len(values) == world_size else 0.1)
            if process.is_alive():
                process.kill()
                process.join()
    return [values[rank] for rank in range(world_size)]

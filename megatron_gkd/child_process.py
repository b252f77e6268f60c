"""Services a run starts as child processes (the teacher service, the rollout server), and ports for them.

A child leads its own process group (it may start processes of its own), writes to a log file (never
an unread pipe), announces itself with a ``READY`` line, and stops when the process that started it
dies, even by SIGKILL (:func:`exit_with_parent`, which the child calls). :meth:`ServiceProcess.stop`
signals the whole group and waits.

A process group holds only the processes that stay in it: one started in a session of its own (as code-execution
graders start their sandboxes) leaves it. A process that must take its whole tree with it becomes a subreaper
(:func:`become_subreaper`: orphans of its descendants are re-parented to it, not to init, so they stay in its tree)
and its tree is killed by walking ``/proc`` (:func:`kill_descendants`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import time

logger = logging.getLogger(__name__)

# A child is one process, not a member of its parent's torchrun world.
_WORLD_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK")
_handed_out: set[int] = set()
_PR_SET_CHILD_SUBREAPER = 36
# (this process, its parent) when this module was imported, early in a child's start-up: a parent that dies
# while the child is still loading (before it calls exit_with_parent) must be noticed too, and by then
# os.getppid() already names the process that adopted the orphan.
_STARTED_AS = (os.getpid(), os.getppid())
# The parent's pid, as the parent put it into the child's environment (ServiceProcess): it closes the window before
# this module is imported (the interpreter's start, under load seconds), in which a parent's death went unnoticed.
PARENT_PID_ENV = "MEGATRON_GKD_PARENT_PID"


def exit_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux ``PR_SET_PDEATHSIG``); at once if it already has.

    Call it from the child's main thread once its signal handlers are installed.
    """
    pid, parent = _STARTED_AS
    declared = os.environ.get(PARENT_PID_ENV, "")
    if declared.isdigit() and pid == os.getpid():
        parent = int(declared)
    if pid != os.getpid():  # a fork of the process that imported this module: its parent is that process
        parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def become_subreaper() -> None:
    """Adopts this process's orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``): a descendant whose parent
    exits is re-parented to this process instead of init, so :func:`kill_descendants` still finds it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _process_table() -> tuple[dict[int, list[int]], set[int]]:
    """The children of every process, and the zombies (exited, not yet reaped), from ``/proc``."""
    children: dict[int, list[int]] = {}
    zombies: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                state, parent = stat.read().rsplit(")", 1)[1].split()[:2]  # the name may hold ") "
        except (OSError, ValueError):
            continue  # exited while the table was read
        children.setdefault(int(parent), []).append(int(entry.name))
        if state == "Z":
            zombies.add(int(entry.name))
    return children, zombies


def _walk(pid: int) -> tuple[list[int], set[int]]:
    """The live descendants of ``pid`` (parents before their children), and the whole tree with its zombies.

    Zombies are walked through, not listed: a process that has just exited may still be read as the parent of a
    child that the kernel is re-parenting.
    """
    (children, zombies), tree = _process_table(), [pid]
    for process in tree:  # grows as it is walked
        tree += children.get(process, ())
    return [process for process in tree[1:] if process not in zombies], set(tree)


def descendants(pid: int) -> list[int]:
    """The live descendants of ``pid``, parents before their children."""
    return _walk(pid)[0]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _kill_listed(child: int, tree: set[int]) -> None:
    """SIGKILLs ``child`` if it is still the process listed in ``tree`` (its parent is in it)."""
    try:
        handle = os.pidfd_open(child)
    except ProcessLookupError:  # exited already
        return
    except OSError as error:
        if error.errno != errno.ENOSYS:
            return
        # A kernel before 5.3 has no pidfds: the parent check and the signal are then two steps.
        if _parent(child) in tree:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
        return
    try:
        if _parent(child) in tree:  # still the process listed, not a reused pid
            signal.pidfd_send_signal(handle, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(handle)


def kill_descendants(pid: int, timeout_s: float = 10.0) -> bool:
    """SIGKILLs every descendant of ``pid`` (not ``pid``) until none is left; whether none is.

    Sessions and process groups of their own do not hide a descendant. ``pid`` should be a subreaper
    (:func:`become_subreaper`) that is still alive: a descendant whose parent is killed first is then re-parented to
    it and found by the next pass, instead of escaping to init. Each process is signalled through a pidfd opened
    before its parent is checked again, so a pid reused by an unrelated process in between is never signalled.
    """
    end, empty_reads = time.monotonic() + timeout_s, 0
    while empty_reads < 2:  # an empty tree is believed when read twice: a child being re-parented can be missed once
        found, tree = _walk(pid)
        empty_reads = 0 if found else empty_reads + 1
        for child in found:
            _kill_listed(child, tree)
        if found and time.monotonic() > end:
            return False
        time.sleep(0.005)  # SIGKILL is delivered at once; the process becomes a zombie shortly after
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, below the ephemeral range.

    Ports from ``bind(0)`` come from the ephemeral range, where outgoing connections (gloo opens many)
    take their source ports: between choosing one and listening on it, a connection can take it. Ports
    below the range are taken only by listeners, and this process never hands out one twice.
    """
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 20000), low)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServiceProcess:
    """A child service: started at once, :meth:`wait_ready` for its ``READY`` line, :meth:`stop`.

    Args:
        name: for messages (e.g. ``"teacher service"``).
        args: the command.
        log_path: where its output goes.
        env: extra environment variables (secrets travel here, not on the command line).
        ready: a regular expression matching its READY line; group 1, if any, is returned by :meth:`wait_ready`.
    """

    def __init__(self, name: str, args: list[str], log_path: str | os.PathLike, *, env: dict | None = None,
                 ready: str = r"READY(.*)"):
        self.name = name
        self.log_path = pathlib.Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._ready = re.compile(ready)
        environment = {key: value for key, value in os.environ.items() if key not in _WORLD_VARIABLES}
        environment.update(env or {}, **{PARENT_PID_ENV: str(os.getpid())})
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                            start_new_session=True)
        logger.info("%s starting (pid %d); log: %s", name, self.process.pid, self.log_path)

    def wait_ready(self, timeout_s: float) -> str:
        """Waits for the READY line; returns its first group (or the whole line).

        Raises:
            RuntimeError: the child exited or was not ready within ``timeout_s`` (quoting its log).
        """
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            match = self._ready.search(self.log_path.read_text(errors="replace"))
            if match:
                logger.info("%s ready", self.name)
                return match.group(1) if match.groups() else match.group(0)
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        state = (f"exited with code {self.process.returncode}" if self.process.poll() is not None
                 else f"was not ready after {timeout_s:.0f} s")
        self.stop()
        raise RuntimeError(f"the {self.name} {state}; its log {self.log_path} ends with:\n{tail}")

    def stop(self) -> None:
        """Stops the child and everything it started (SIGTERM, then SIGKILL after 30 s)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        try:  # children that outlived the service
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

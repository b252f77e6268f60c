"""Rewards of a batch computed off the caller's thread, in a worker process, with a per-call timeout.

``RewardRunner.submit(batch)`` returns at once with a Future, like a teacher client's ``score_async``: a step
sends its rewards beside its teacher request and waits for both before it trains. Every way a reward can
fail ends in one error, :class:`RewardFailed`, naming the reward (the kind, or the user's ``module:function``)
and the record (its place in the batch, its id and the end of its prompt); no partial result is ever
returned, so no step is trained on a missing reward.

| failure | what :class:`RewardFailed` says |
|---|---|
| the function raises | the exception and the first record that raises alone (found by calling it per record) |
| no answer within ``reward.timeout_s`` | the batch's records; the worker is killed (a fresh one serves the next call) |
| the worker dies (a crash in C code, ``os._exit``) | its exit code and the batch's records |
| a reply that cannot be read | why, and the batch's records; the worker is killed |
| wrong length, not a sequence | the length or type returned and the batch's records |
| an item that is not a number, NaN / inf, or past ``reward.max_abs`` | the value and its record |
| a record without a field the kind needs (``answer``) | the record and the field |

**Why a process, not a thread.** A thread cannot be stopped: a hung function keeps its thread until the process
exits, and one that spins in Python keeps half of the interpreter's time from the trainer's own thread (a
pure-Python loop took 0.146 s beside one spinning thread against 0.072 s alone, on the 2-core development machine);
a pool's threads are joined at exit, which then hangs. The worker is killed instead (its whole tree: a function may
start processes, even in sessions of their own, see :mod:`.worker`), dies with the trainer (``PR_SET_PDEATHSIG``, and
a finalizer at exit), and its Python code never competes with the trainer's for the GIL. What it costs: two
processes per runner (a supervisor and the one that computes, about 0.1 s to start, plus importing the user's
module); each call pickles the batch's text through a pipe (measured by ``benchmarks/reward_overlap.py``); the user's
function must be importable by name from a fresh interpreter (not defined in ``__main__``); calls are served one at a
time, in order; a killed worker loses whatever it had loaded, and the next call pays a fresh start.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref

from megatron_gkd.child_process import kill_descendants
from megatron_gkd.rewards.config import DEFAULT_MAX_ABS
from megatron_gkd.rewards.kinds import REWARDS, kind_target, reward_name
from megatron_gkd.rewards.protocol import describe_error, read_frame, write_frame

logger = logging.getLogger(__name__)

WORKER_MODULE = "megatron_gkd.rewards.worker"
_START = object()  # a queue item that (re)starts the worker
_TIMEOUT = object()
_EXCERPT = 60
# A batch's rewards are a few bytes a response; a longer reply is a stray write into the pipe, not a reply.
_MAX_REPLY_BYTES = 256 << 20


class RewardFailed(RuntimeError):
    """A batch's rewards could not be computed: the run stops after its last complete step.

    Attributes:
        reward: the reward's name (the kind, or the user's ``module:function``).
        record: the failing record's place in the batch, or None when the whole batch is named.
    """

    def __init__(self, reward: str, message: str, record: int | None = None):
        super().__init__(f"reward {reward!r} {message}")
        self.reward, self.record = reward, record


def _excerpt(prompt: str) -> str:
    # The end of a prompt: a chat template puts the question last.
    return repr(prompt if len(prompt) <= _EXCERPT else "..." + prompt[-_EXCERPT:])


@dataclasses.dataclass(frozen=True, slots=True)
class RewardBatch:
    """The responses to reward, with their prompts and records.

    Attributes:
        prompts: each response's prompt text.
        responses: the response texts.
        records: each response's record fields (e.g. ``{"index": 17, "answer": "432", "group": "add2"}``;
            ``index``, or ``id``, names the record in messages).
    """

    prompts: list[str]
    responses: list[str]
    records: list[dict]

    def __post_init__(self):
        if not len(self.prompts) == len(self.responses) == len(self.records):
            raise ValueError(f"RewardBatch: {len(self.prompts)} prompts, {len(self.responses)} responses and "
                             f"{len(self.records)} records; give one of each per response")

    def __len__(self) -> int:
        return len(self.responses)

    def record_id(self, i: int):
        return self.records[i].get("index", self.records[i].get("id"))

    def describe(self, i: int) -> str:
        """``record i of n (id ..., prompt '...')``."""
        return f"record {i} of {len(self)} (id {self.record_id(i)!r}, prompt {_excerpt(self.prompts[i])})"

    def describe_all(self) -> str:
        """The whole batch, for failures that no one record explains (a hang, a wrong length)."""
        ids = ", ".join(repr(self.record_id(i)) for i in range(min(len(self), 8))) + (", ..." if len(self) > 8 else "")
        return f"a batch of {len(self)} records (ids {ids}; first prompt {_excerpt(self.prompts[0])})"


@dataclasses.dataclass(frozen=True, slots=True)
class RewardOutput:
    """A batch's rewards.

    Attributes:
        values: one finite float per response, in order.
        seconds: time spent in the reward function (in the worker).
        wall_s: from the call's start on the runner's thread to its result (worker start, pipe and validation
            included; a call queued behind another does not count its wait).
    """

    values: list[float]
    seconds: float
    wall_s: float


def check_values(reward: str, reply: tuple, batch: RewardBatch, *, max_abs: float = DEFAULT_MAX_ABS) -> list[float]:
    """The validated rewards of ``batch`` from the worker's plain reply (see :func:`.protocol.plain`).

    Args:
        max_abs: the largest ``|reward|`` accepted (``reward.max_abs``).

    Raises:
        RewardFailed: not a sequence, a wrong length, an item that is not a number, a non-finite value, or one
            past ``max_abs``.
    """
    if reply[0] != "sequence":
        _, type_name, text = reply
        raise RewardFailed(reward, f"returned a {type_name} ({text}) for {batch.describe_all()}; it must return a "
                                   f"sequence of {len(batch)} floats, one per response")
    items = reply[1]
    if len(items) != len(batch):
        raise RewardFailed(reward, f"returned {len(items)} values for {batch.describe_all()}; it must return one "
                                   "per response")
    for i, value in enumerate(items):
        if isinstance(value, tuple):
            raise RewardFailed(reward, f"returned a {value[0]} ({value[1]}) for {batch.describe(i)}; rewards must be "
                                       "numbers", record=i)
        if not math.isfinite(value):
            raise RewardFailed(reward, f"returned {value} for {batch.describe(i)}; rewards must be finite", record=i)
        if abs(value) > max_abs:
            raise RewardFailed(reward, f"returned {value} for {batch.describe(i)}; rewards must be within "
                                       f"+-reward.max_abs={max_abs}", record=i)
    return items


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        # The worker is a subreaper: every process the reward started is in its tree, whatever its session.
        kill_descendants(process.pid)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    try:
        process.stdin.close()  # stdout belongs to the reader thread, which closes it at the end of the stream
    except OSError:
        pass


class _Worker:
    """One worker process and the thread that reads its replies into a queue."""

    def __init__(self, setup: dict):
        env = dict(os.environ)
        # The child imports the user's module with this process's path (not only the interpreter's default).
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path for path in sys.path if path))
        self.process = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, start_new_session=True)
        self._finalizer = weakref.finalize(self, _kill, self.process)  # also at interpreter exit
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, name="reward-worker-reader", daemon=True).start()
        self.send(setup)

    def _read(self) -> None:
        try:
            while (frame := read_frame(self.process.stdout, _MAX_REPLY_BYTES)) is not None:
                self.replies.put(frame)
        except Exception as error:  # noqa: BLE001 - a reply that cannot be read fails the call that waits for it
            self.replies.put(("corrupt", describe_error(error)))
        finally:
            self.process.stdout.close()
        self.replies.put(None)

    def send(self, obj) -> bool:
        """False when the worker is gone."""
        try:
            write_frame(self.process.stdin, obj)
            return True
        except (OSError, ValueError):
            return False

    def receive(self, timeout: float):
        """The next reply, None when the worker exited, or ``_TIMEOUT``."""
        try:
            return self.replies.get(timeout=timeout)
        except queue.Empty:
            return _TIMEOUT

    def wait_exit(self, timeout: float) -> None:
        """Gives the worker ``timeout`` seconds to exit by itself."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> int:
        """Kills the worker and every process in its tree; its exit code."""
        self._finalizer()
        return self.process.returncode


class RewardRunner:
    """Computes batches of rewards in a worker process (see the module docstring: why a process).

    The worker starts at once, in the background; :meth:`wait_ready` raises the start-up's failure (a user
    module that does not import) so that the trainer can fail before its first step.

    Args:
        config: the ``reward`` section (:class:`~megatron_gkd.rewards.config.RewardConfig`) with a ``kind``.
    """

    def __init__(self, config):
        if not config.enabled:
            raise ValueError("reward.kind is null: there is no reward to compute")
        self.config = config
        self.name = reward_name(config)
        self._needs = REWARDS.get(config.kind).needs_for(config)
        self._setup = {"target": kind_target(config.kind), "kind": config.kind, "config": dataclasses.asdict(config)}
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: _Worker | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="reward-runner", daemon=True)
        self._thread.start()
        self._ready = self._put(_START)

    def _put(self, item) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the reward runner is closed")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, item))
        return future

    def wait_ready(self, timeout: float | None = None) -> None:
        """Blocks until the worker has built the reward.

        Raises:
            RewardFailed: the worker could not build it (the error names the reward), or did not start in
                ``reward.start_timeout_s``.
        """
        self._ready.result(timeout)

    def submit(self, batch: RewardBatch) -> concurrent.futures.Future:
        """The batch's :class:`RewardOutput` as a Future (its exception: :class:`RewardFailed`); returns at once."""
        return self._put(batch)

    def compute(self, batch: RewardBatch) -> RewardOutput:
        """Like :meth:`submit`, blocking."""
        return self.submit(batch).result()

    # ------------------------------------------------------------------------- the runner's thread
    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, item = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._start() if item is _START else self._run(item))
            except BaseException as error:  # noqa: BLE001 - handed to the caller through its future
                future.set_exception(error)

    def _start(self) -> None:
        if self._worker is not None:
            return
        worker, wait = _Worker(self._setup), self.config.start_timeout_s
        reply = worker.receive(wait)
        if self._closed or reply is _TIMEOUT or reply is None or reply[0] != "ready":
            code = worker.kill()
            if self._closed:
                raise RewardFailed(self.name, "was not started: the runner was closed")
            if reply is _TIMEOUT:
                raise RewardFailed(self.name, f"could not start: its worker was not ready within "
                                              f"reward.start_timeout_s={wait} s")
            raise RewardFailed(self.name, f"could not start: {reply[1] if reply else f'its worker exited ({code})'}")
        self._worker = worker

    def _run(self, batch: RewardBatch) -> RewardOutput:
        start = time.perf_counter()
        if not len(batch):
            return RewardOutput([], 0.0, 0.0)
        for i, record in enumerate(batch.records):
            for field in self._needs:
                if record.get(field) is None:
                    raise RewardFailed(self.name, f"cannot score {batch.describe(i)}: it has no {field!r} (set "
                                                  f"data.{field}_key to the field that holds it)", record=i)
        self._start()
        worker, timeout = self._worker, self.config.timeout_s
        reply = worker.receive(timeout) if worker.send((batch.prompts, batch.responses, batch.records)) else None
        if reply is _TIMEOUT or reply is None:
            if reply is None:  # the computing process has exited; its supervisor exits as it did, after the tree
                worker.wait_exit(5.0)
            self._worker, code = None, worker.kill()
            if self._closed:
                raise RewardFailed(self.name, f"was stopped: the runner was closed during {batch.describe_all()}")
            if reply is _TIMEOUT:
                raise RewardFailed(self.name, f"gave no rewards within reward.timeout_s={timeout} s for "
                                              f"{batch.describe_all()}; its worker was killed")
            raise RewardFailed(self.name, f"failed: its worker exited (code {code}) during {batch.describe_all()}")
        if reply[0] == "corrupt":
            self._worker = None
            worker.kill()
            raise RewardFailed(self.name, f"sent a reply that cannot be read ({reply[1]}) for {batch.describe_all()}; "
                                          "its worker was killed")
        if reply[0] == "raised":
            _, error, record, text, _ = reply
            logger.error("reward %r raised in its worker:\n%s", self.name, text)
            where = batch.describe(record) if record is not None else batch.describe_all()
            raise RewardFailed(self.name, f"raised {error} on {where}", record=record)
        return RewardOutput(check_values(self.name, reply[1], batch, max_abs=self.config.max_abs), reply[2],
                            time.perf_counter() - start)

    def close(self) -> None:
        """Cancels the calls not started, stops the one running and the worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call[0].cancel()
        self._calls.put(None)
        worker = self._worker
        if worker is not None:
            worker.kill()
        self._thread.join(timeout=5.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

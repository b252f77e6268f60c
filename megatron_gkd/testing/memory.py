"""Peak anonymous resident memory of this process over a block of code (Linux ``/proc``).

Anonymous memory is what tensors and Python objects allocate; memory-mapped files (safetensors read
through ``safe_open``) are file-backed and do not count, so the meter sees what a loader *allocates*,
not what it reads. A thread samples ``RssAnon`` every 0.5 ms; operations shorter than that can be
missed, so use it for allocations that live at least that long (parameters, copies of tensors).
"""

from __future__ import annotations

import threading


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("RssAnon missing from /proc/self/status")


class AnonPeak:
    """``with AnonPeak() as meter: ...`` then ``meter.increase``: peak minus the value at entry."""

    def __init__(self, interval_s: float = 0.0005):
        self.interval_s = interval_s
        self.baseline = self.peak = 0

    def __enter__(self):
        self.baseline = self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_anon())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def increase(self) -> int:
        return self.peak - self.baseline


class LiveTensorPeak:
    """Peak of the bytes held by live CPU tensors inside labelled regions, from the torch profiler.

    With ``profile_memory=True`` the profiler records every allocation and free of torch's CPU
    allocator (size and time, on any thread the profiler follows). Summing them in time order gives
    the live tensor bytes at each moment since :meth:`__enter__`; :meth:`peak` is the largest value
    reached inside regions marked with :meth:`region`. This is the host analogue of
    the accelerator allocator's ``max_memory_allocated``: what a plan predicts, free of the C allocator's caching and
    of Python objects, which the process's RSS would include. It reads the profiler's event tree
    (``kineto_results.experimental_event_tree``), a semi-private torch API (checked on torch 2.13).
    """

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        self._profile.__exit__(*exc)

    @staticmethod
    def region(name: str):
        """``with meter.region("step"): ...`` marks where :meth:`peak` looks."""
        from torch.profiler import record_function

        return record_function(name)

    def peak(self, region: str) -> int:
        """The largest live tensor bytes (counted from entry) reached inside any ``region`` range."""
        from torch._C._profiler import _EventType

        allocations, ranges = [], []
        stack = list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.tag == _EventType.Allocation:
                allocations.append((event.start_time_ns, event.extra_fields.alloc_size))
            elif event.name == region:
                ranges.append((event.start_time_ns, event.end_time_ns))
        if not ranges:
            raise ValueError(f"no profiled region named {region!r}")
        live, best = 0, None
        for time_ns, size in sorted(allocations):
            live += size
            if any(start <= time_ns <= end for start, end in ranges):
                best = live if best is None else max(best, live)
        return best if best is not None else 0

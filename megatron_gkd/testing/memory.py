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

"""A test-only backend plugin (``--backend-module``): the hf backend that marks and delays each request.

The marker file tells a test that a request has reached this worker (its name starts with the worker's
pid), so the worker can be killed while it is provably busy with that request. With ``hold_file`` a
request is delayed only if that file exists when it arrives: one replica of several can be made to
hold a request while the others answer at once.
"""

import os
import pathlib
import time
import uuid

from megatron_gkd.teacher.backends import register_backend
from megatron_gkd.teacher.backends.hf import HFBackend


class SlowHFBackend(HFBackend):
    def __init__(self, model: str, marker_dir: str, delay_s: float, hold_file: str | None = None, **kwargs):
        super().__init__(model, **kwargs)
        self._marker_dir, self._delay_s = pathlib.Path(marker_dir), delay_s
        self._hold_file = None if hold_file is None else pathlib.Path(hold_file)

    def score(self, batch):
        (self._marker_dir / f"{os.getpid()}-{uuid.uuid4().hex}").touch()
        if self._hold_file is None or self._hold_file.exists():
            time.sleep(self._delay_s)
        return super().score(batch)


register_backend("hf_slow", f"{__name__}:SlowHFBackend")

"""A test-only backend plugin (``--backend-module``): the hf backend that marks and delays each request.

The marker file tells a test that a request has reached this worker, so the worker can be killed
while it is provably busy with that request.
"""

import pathlib
import time
import uuid

from megatron_gkd.teacher.backends import register_backend
from megatron_gkd.teacher.backends.hf import HFBackend


class SlowHFBackend(HFBackend):
    def __init__(self, model: str, marker_dir: str, delay_s: float, **kwargs):
        super().__init__(model, **kwargs)
        self._marker_dir, self._delay_s = pathlib.Path(marker_dir), delay_s

    def score(self, batch):
        (self._marker_dir / uuid.uuid4().hex).touch()
        time.sleep(self._delay_s)
        return super().score(batch)


register_backend("hf_slow", f"{__name__}:SlowHFBackend")

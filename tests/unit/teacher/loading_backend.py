"""A test-only backend plugin (``--backend-module``): one that takes a minute to load, as a large teacher does
under load, and says which process is loading it (its pid, a line of ``$LOADING_BACKEND_PID_FILE``)."""

import os
import time

from megatron_gkd.teacher.backends import register_backend


class LoadingBackend:
    def __init__(self, model: str):
        with open(os.environ["LOADING_BACKEND_PID_FILE"], "a") as out:
            out.write(f"{os.getpid()}\n")
        time.sleep(60)


register_backend("slow_loading", f"{__name__}:LoadingBackend")

"""The teacher service caps glibc's malloc arenas (``platform.limit_malloc_arenas``): threads alive together then
share 2 arenas instead of one each, which glibc itself reports (``malloc_info``); the environment's
``MALLOC_ARENA_MAX`` is left to rule."""

import ctypes.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or "libc.so" not in str(ctypes.util.find_library("c")),
                                reason="glibc only")

PROBE = """
import ctypes, ctypes.util, sys, tempfile, threading
from megatron_gkd import platform
capped = platform.limit_malloc_arenas() if sys.argv[1] == "cap" else None
barrier, kept = threading.Barrier(8), []
def work():
    barrier.wait()  # alive together: glibc gives each a new arena unless capped
    kept.append(bytes(200_000))  # malloc'd (not Python's small-object pool) in this thread's arena
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile() as out:
    stream = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    print(capped, open(out.name).read().count("<heap nr="))
"""


def _arenas(mode: str, **env) -> tuple[str, int]:
    environment = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    capped, heaps = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                                   env=environment).stdout.split()
    return capped, int(heaps)


def test_the_cap_makes_threads_share_two_arenas():
    assert _arenas("free")[1] > 2  # the main arena and one for each thread (9 on 2 cores; 8 per core at most)
    assert _arenas("cap") == ("True", 2)


def test_the_environment_rules():
    assert _arenas("cap", MALLOC_ARENA_MAX="4") == ("False", 4)

"""A tiny random teacher checkpoint and an in-process teacher service (proxy + hf worker) on loopback."""

import numpy as np
import pytest

from megatron_gkd.teacher.backends import build_backend
from megatron_gkd.teacher.protocol import wire
from megatron_gkd.teacher.service.server import Proxy, Worker
from megatron_gkd.testing.tiny_teacher import build_tiny_teacher

SECRET = b"unit-test-secret"
LIMITS = wire.Limits(max_message_bytes=256 * 2**10)


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory):
    return build_tiny_teacher(tmp_path_factory.mktemp("tiny_teacher"))


@pytest.fixture(scope="module")
def service(teacher_dir):
    """(proxy, worker) with the hf backend and HMAC, on 127.0.0.1 ports picked by the OS."""
    proxy = Proxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secret=SECRET, limits=LIMITS).start()
    worker = Worker(proxy.backend_address, build_backend("hf", model=str(teacher_dir)), secret=SECRET,
                    limits=LIMITS).start()
    yield proxy, worker
    worker.close()
    proxy.close()


def random_sequences(num: int, vocab: int, seed: int = 0):
    """(token_ids, response_start) pairs of varied lengths, including a 1-token prompt and response."""
    rng = np.random.default_rng(seed)
    shapes = [(2, 1), (9, 8)] + [(int(n), int(rng.integers(1, n))) for n in rng.integers(3, 40, num - 2)]
    return [(rng.integers(3, vocab, n), start) for n, start in shapes[:num]]

"""``launch/teacher_server.py --backend megatron`` under torchrun (TP=2): rank 0 serves, rank 1 follows."""

import numpy as np
import pytest

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, build_client
from megatron_gkd.testing.distributed import free_port
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher, build_tiny_teacher
from tests.e2e.teacher import procs
from tests.unit.teacher.conftest import random_sequences

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

VOCAB = 512


def test_torchrun_megatron_server_matches_transformers(tmp_path):
    teacher = build_tiny_teacher(tmp_path / "teacher", vocab_size=VOCAB, num_key_value_heads=2, num_layers=1)
    args = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "launch/teacher_server.py", "serve", "--frontend", "tcp://127.0.0.1:0", "--backend", "megatron",
            "--model", str(teacher), "--backend-arg", "tensor_model_parallel_size=2"]
    server = procs.start(args, "READY frontend=", 300, tmp_path / "server.log")
    try:
        address = server.ready_line.split("frontend=")[1].split()[0]
        rng = np.random.default_rng(0)
        sequences = random_sequences(4, VOCAB, seed=6)
        requested = [rng.integers(0, VOCAB, (len(ids) - start, 5)) for ids, start in sequences]
        batch = ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=start, requested_ids=r)
                                      for (ids, start), r in zip(sequences, requested)], top_k=32)
        with build_client("zmq", address=address, retry=RetryPolicy(attempt_timeout_s=120, deadline_s=240)) as client:
            assert client.info().vocab_size == VOCAB
            for _ in range(2):  # the followers stay in step across requests
                outputs = client.score(batch)
        reference = ReferenceTeacher(teacher)
        for output, (ids, start), r in zip(outputs, sequences, requested):
            reference.assert_matches(output, ids, start, 32, requested_ids=r)
    finally:
        procs.stop(server)
    # SIGTERM reached both ranks: rank 0 closed the backend (releasing rank 1), and nothing is left.
    assert server.returncode is not None

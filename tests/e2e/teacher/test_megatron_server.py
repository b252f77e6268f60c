"""``launch/teacher_server.py --backend megatron`` under torchrun (TP=2): rank 0 serves, rank 1 follows; both signals
and generation."""

import dataclasses

import numpy as np
import pytest

from megatron_gkd.teacher import GenerateBatch, RetryPolicy, ScoreBatch, SequenceRequest, build_client
from megatron_gkd.teacher.backends import build_backend
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
            # The hidden signal between two top-k requests: the followers learn the kind from the header.
            hidden_batch = ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=start)
                                                 for ids, start in sequences], top_k=1, signal="hidden")
            hidden = client.score(hidden_batch)
            assert [o.topk_ids.tolist() for o in client.score(batch)] == [o.topk_ids.tolist() for o in outputs]
            # Generation: the leader's loop scores through the followers at every token.
            sampled = GenerateBatch(prompts=[ids[:start] for ids, start in sequences[:3]], num_samples=2,
                                    max_tokens=5, seed=4, score_top_k=4)
            greedy = dataclasses.replace(sampled, num_samples=1, temperature=0)
            generated = [client.generate(sampled), client.generate(greedy)]
            assert [o.topk_ids.tolist() for o in client.score(batch)] == [o.topk_ids.tolist() for o in outputs]
        hf_backend = build_backend("hf", model=str(teacher))
        for got, request in zip(generated, (sampled, greedy)):
            # One sampling policy and per-response seeds: the same responses as the hf backend samples.
            want = hf_backend.generate(request)
            assert [s.response_ids.tolist() for s in got] == [s.response_ids.tolist() for s in want]
        for sample in generated[1]:
            np.testing.assert_array_equal(sample.response_ids, sample.output.topk_ids[:, 0])
        hf = hf_backend.score(dataclasses.replace(hidden_batch, hidden_dtype="float32"))
        for got, want in zip(hidden, hf, strict=True):
            # bf16 on the wire: within half a bf16 ulp (2**-9 relative) of the float32 values.
            np.testing.assert_allclose(got.hidden, want.hidden, rtol=2**-8, atol=1e-5)
            np.testing.assert_allclose(got.token_logprobs, want.token_logprobs, rtol=0, atol=1e-4)
        reference = ReferenceTeacher(teacher)
        for output, (ids, start), r in zip(outputs, sequences, requested):
            reference.assert_matches(output, ids, start, 32, requested_ids=r)
    finally:
        procs.stop(server)
    # SIGTERM reached both ranks: rank 0 closed the backend (releasing rank 1), and nothing is left.
    assert server.returncode is not None
    # The service says what it held as it stops (benchmarks read it: the teacher's memory beside the trainer's).
    assert "teacher serve stopped: peak RSS" in (tmp_path / "server.log").read_text()

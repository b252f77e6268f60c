"""A failed weight sync never leaves a rollout engine serving half-updated weights (issue 14, item 7).

Two trainer ranks (TP=2) and one rollout process joined only by the weight-sync transport, whose engine
is the recording stand-in (it loads tensors as they stream in, as vLLM's reload does, and its responses
carry its weight version).

* A corrupted bucket (rank 0's part of bucket 2): the disaggregated server's engine is marked stale and
  its batches are refused with an error naming the failed version, the trainers learn of the failure
  from ``sender.sync``, the server keeps serving, and a retry delivers every trained tensor.
* A sender that stops mid-sync: the rollout rank gives up after the transport's timeout (seconds here,
  not the old 600 s) and its engine refuses to generate.
"""

from __future__ import annotations

import inspect
import os
import time

import pytest
import torch

from megatron_gkd.rollout import SamplingConfig
from megatron_gkd.testing.distributed import free_port, run_distributed
from megatron_gkd.testing.hf_models import make_tiny_checkpoint
from megatron_gkd.weight_sync import TorchDistributedTransport, WeightSyncConfig

pytestmark = pytest.mark.distributed

PROMPTS = [[3, 17, 42], [7, 7, 250, 1]]
SAMPLING = SamplingConfig(n=1, max_tokens=2)
TIMEOUT_S = 3.0


def _transport(port: int, rank: int):
    return TorchDistributedTransport(address="127.0.0.1", port=port, rank=rank, num_trainer_ranks=2,
                                     num_rollout_ranks=1, timeout_s=TIMEOUT_S, idle_timeout_s=120)


def _corrupt_part_of_bucket(sender, transport, bucket_index: int) -> None:
    """This rank's part of ``bucket_index`` (or the next it has) arrives with one byte changed."""
    real_send, real_post = transport.send, transport.post
    position = next(i for i, (bucket, _) in enumerate(sender.work) if bucket.index >= bucket_index)
    calls = []

    def send(part, buffer):
        calls.append(part)
        if len(calls) == position + 1:
            buffer = buffer.clone()
            buffer[3] ^= 1
        return real_send(part, buffer)

    def post(owner, tensors, buffer=None):  # direct transfer: slices, then the trailer, per part
        calls.append(owner)
        if len(calls) == 2 * position + 1:
            corrupted = tensors[0].clone()
            corrupted.view(-1)[0] += 1
            tensors = [corrupted, *tensors[1:]]
        return real_post(owner, tensors, buffer)

    transport.send, transport.post = send, post


def _trainer(path: str, trainer_port: int, sync_port: int, config):
    from megatron_gkd import parallel
    from megatron_gkd.models import export_hf_weights
    from megatron_gkd.rollout import StaleWeightsError
    from megatron_gkd.rollout.remote import RolloutClient
    from megatron_gkd.testing.weight_sync import tp2_trainer, train
    from megatron_gkd.weight_sync import WeightSyncError

    rank = int(os.environ["RANK"])
    chunks, optimizer, transport, sender = tp2_trainer(path, trainer_port, lambda rank: _transport(sync_port, rank), config)
    client = RolloutClient(transport.world, server_rank=2, trainer_rank=0, max_model_len=64)
    before = client.generate(PROMPTS, SAMPLING)
    train(chunks, optimizer, 2, chunks[0].module.hf_model_info.hf_config["vocab_size"])
    real = transport.send, transport.post
    if rank == 0:
        _corrupt_part_of_bucket(sender, transport, bucket_index=2)
    client.update_weights(1)
    with pytest.raises(WeightSyncError, match="version 1") as failed_sync:
        sender.sync(chunks, version=1)
    with pytest.raises(StaleWeightsError, match="version 1") as refused:
        client.generate(PROMPTS, SAMPLING)
    transport.send, transport.post = real
    client.update_weights(1)  # the trainer retries the same version
    sender.sync(chunks, version=1)
    after = client.generate(PROMPTS, SAMPLING)
    client.close()
    trained = {name: tensor.clone() for name, tensor in export_hf_weights(chunks, owner_only=False)}
    transport.close()
    parallel.destroy()
    return dict(before=before, after=after, trained=trained, failed_sync=str(failed_sync.value), refused=str(refused.value))


def _server(sync_port: int, config):
    from megatron_gkd.rollout.remote import RolloutServer
    from megatron_gkd.testing.weight_sync import RecordingEngine
    from megatron_gkd.weight_sync import WeightReceiver, connect_rollout

    transport = _transport(sync_port, 2)
    plan = connect_rollout(transport)
    engine = RecordingEngine()
    receiver = WeightReceiver(plan, transport, config)
    server = RolloutServer(engine, transport.world, server_rank=2, trainer_rank=0, receiver=receiver)
    answered = server.serve()
    transport.close()
    return dict(answered=answered, version=engine.weight_version, stale=engine.stale, weights=engine.weights,
                num_buckets=len(receiver.buckets))


def _server_rank(path, trainer_port, sync_port, config):
    if int(os.environ["RANK"]) < 2:
        return _trainer(path, trainer_port, sync_port, config)
    return _server(sync_port, config)


@pytest.mark.parametrize("transfer", ["packed", pytest.param("direct", marks=pytest.mark.slow)])  # suite time
def test_a_corrupted_bucket_leaves_the_engine_stale_and_the_server_serving(tmp_path, transfer):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "llama", seed=5)
    config = WeightSyncConfig(bucket_size_mb=48 / 1024, transfer=transfer)
    trainer0, trainer1, server = run_distributed(_server_rank, 3, args=(path, free_port(), free_port(), config),
                                                 init_process_group=False, timeout=300)
    assert server["num_buckets"] > 3
    for trainer in (trainer0, trainer1):
        assert "rollout rank" in trainer["failed_sync"]
        assert "refuses to generate" in trainer["refused"] and "checksum" in trainer["refused"]
        assert trainer["before"].weight_version == 0 and trainer["after"].weight_version == 1
    assert server["answered"] == 3 and server["version"] == 1 and not server["stale"]  # the refused one too
    assert sorted(server["weights"]) == sorted(trainer0["trained"])
    for name, tensor in trainer0["trained"].items():
        torch.testing.assert_close(server["weights"][name], tensor, rtol=0, atol=0, msg=name)


def _stuck_sender_rank(path: str, trainer_port: int, sync_port: int):
    from megatron_gkd import parallel
    from megatron_gkd.rollout import StaleWeightsError
    from megatron_gkd.testing.weight_sync import RecordingEngine, tp2_trainer
    from megatron_gkd.weight_sync import WeightReceiver, WeightSyncError, connect_rollout

    rank = int(os.environ["RANK"])
    config = WeightSyncConfig(bucket_size_mb=48 / 1024, transfer="packed")
    gave_up = os.path.join(os.path.dirname(path), "receiver_gave_up")  # written by the receiver after its timeout
    if rank == 2:
        transport = _transport(sync_port, rank)
        receiver = WeightReceiver(connect_rollout(transport), transport, config)
        engine = RecordingEngine()
        with pytest.raises(WeightSyncError, match="timed out|Timed out|closed|reset") as failed:
            receiver.sync(engine)
        open(gave_up, "w").close()  # the stuck sender may stop hanging now
        with pytest.raises(StaleWeightsError, match="version 1"):
            engine.generate(PROMPTS, SAMPLING)
        return dict(error=str(failed.value), loaded=len(engine.weights), stale=engine.stale)
    chunks, _, transport, sender = tp2_trainer(path, trainer_port, lambda rank: _transport(sync_port, rank), config)
    if rank == 1:  # sends its first two parts, then hangs (a stuck process, a lost link)
        real_send, calls = transport.send, []

        def send(part, buffer):
            calls.append(part)
            if len(calls) == 3:  # hangs until the receiver has timed out (at most 4 timeouts)
                hung_until = time.monotonic() + 4 * TIMEOUT_S
                while not os.path.exists(gave_up) and time.monotonic() < hung_until:
                    time.sleep(0.05)
                raise RuntimeError("the stuck sender gives up")
            return real_send(part, buffer)

        transport.send = send
    try:
        sender.sync(chunks, version=1)
        outcome = "sent"
    except (WeightSyncError, RuntimeError) as error:
        outcome = f"{type(error).__name__}: {error}"
    parallel.destroy()
    return dict(outcome=outcome)


def test_a_sender_stuck_mid_sync_leaves_the_engine_stale_after_the_timeout(tmp_path):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "llama", seed=5)
    *_, rollout = run_distributed(_stuck_sender_rank, 3, args=(path, free_port(), free_port()),
                                  init_process_group=False, timeout=240)
    assert rollout["stale"] and rollout["loaded"] > 0, rollout  # part of the model had been loaded
    assert "weight version 1" in rollout["error"], rollout


def test_the_default_sync_timeout_is_far_below_ten_minutes():
    defaults = inspect.signature(TorchDistributedTransport).parameters
    assert defaults["timeout_s"].default <= 120

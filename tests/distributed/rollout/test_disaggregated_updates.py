"""The disaggregated rollout server takes new weights between requests.

Two trainer ranks (their own world, TP=2) and one rollout process joined only by the weight-sync
transport; the rollout control messages travel over the transport's gloo group. The serving engine is
the recording stand-in (its responses carry its weight version): batches sampled before an update
carry version 0, after it version 1, and the engine holds exactly the trained tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_gkd.rollout import SamplingConfig
from megatron_gkd.testing.distributed import free_port, run_distributed
from megatron_gkd.testing.hf_models import make_tiny_checkpoint
from megatron_gkd.weight_sync import WeightSyncConfig

pytestmark = pytest.mark.distributed

PROMPTS = [[3, 17, 42], [7, 7, 250, 1]]
SAMPLING = SamplingConfig(n=2, max_tokens=4)
CONFIG = WeightSyncConfig(bucket_size_mb=48 / 1024)


def _transport(port: int, rank: int):
    from megatron_gkd.weight_sync import TorchDistributedTransport

    return TorchDistributedTransport(address="127.0.0.1", port=port, rank=rank, num_trainer_ranks=2, num_rollout_ranks=1,
                                     timeout_s=120)


def _trainer(path: str, trainer_port: int, sync_port: int):
    from megatron_gkd import parallel
    from megatron_gkd.models import export_hf_weights
    from megatron_gkd.rollout.remote import RolloutClient
    from megatron_gkd.testing.weight_sync import tp2_trainer, train

    chunks, optimizer, transport, sender = tp2_trainer(path, trainer_port, lambda rank: _transport(sync_port, rank), CONFIG)
    client = RolloutClient(transport.world, server_rank=2, trainer_rank=0, max_model_len=64)
    before = client.generate(PROMPTS, SAMPLING)
    with pytest.raises(ValueError, match="max_model_len"):
        client.generate([[1] * 64], SAMPLING)  # a rejected request leaves the server serving
    train(chunks, optimizer, 2, chunks[0].module.hf_model_info.hf_config["vocab_size"])
    client.update_weights(1)
    sender.sync(chunks, version=1)
    after = client.generate(PROMPTS, SAMPLING)
    client.close()
    trained = {name: tensor.clone() for name, tensor in export_hf_weights(chunks, owner_only=False)}
    transport.close()
    parallel.destroy()
    return dict(before=before, after=after, trained=trained)


def _server(sync_port: int):
    from megatron_gkd.rollout.remote import RolloutServer
    from megatron_gkd.testing.weight_sync import RecordingEngine
    from megatron_gkd.weight_sync import WeightReceiver, connect_rollout

    transport = _transport(sync_port, 2)
    plan = connect_rollout(transport)
    engine = RecordingEngine()
    server = RolloutServer(engine, transport.world, server_rank=2, trainer_rank=0,
                           receiver=WeightReceiver(plan, transport, CONFIG))
    answered = server.serve()
    transport.close()
    return dict(answered=answered, version=engine.weight_version, weights=engine.weights)


def _rank(path: str, trainer_port: int, sync_port: int):
    if int(os.environ["RANK"]) < 2:
        return _trainer(path, trainer_port, sync_port)
    return _server(sync_port)


def test_server_takes_new_weights_between_requests(tmp_path):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "llama", seed=5)
    trainer0, trainer1, server = run_distributed(_rank, 3, args=(path, free_port(), free_port()),
                                                 init_process_group=False, timeout=300)
    for trainer in (trainer0, trainer1):
        assert trainer["before"].weight_version == 0 and trainer["after"].weight_version == 1
        assert trainer["before"].response_ids[:, 0].tolist() == [0] * 4
        assert trainer["after"].response_ids[:, 0].tolist() == [1] * 4
        assert trainer["after"].group_ids.tolist() == [0, 0, 1, 1]
    assert server["answered"] == 3 and server["version"] == 1
    assert sorted(server["weights"]) == sorted(trainer0["trained"])
    for name, tensor in trainer0["trained"].items():
        torch.testing.assert_close(server["weights"][name], tensor, rtol=0, atol=0, msg=name)

"""Bucket layout, packing, checksums and the plan's serialisation, on synthetic plans (no Megatron)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_gkd.weight_sync import ChecksumMismatch, ColocatedTransport, TensorSpec, WeightReceiver, WeightSyncConfig, WeightSyncPlan, layout_buckets
from megatron_gkd.weight_sync.buckets import allocate, pack, pack_stream, unpack

MB = 2**20


def _entry(name, shape, dtype="float32", owner=0, position=0, pp_rank=0):
    return TensorSpec(name=name, shape=tuple(shape), dtype=dtype, pp_rank=pp_rank, vpp_chunk=0, tp_dim=0, tp_size=2,
                      expert=None, megatron="m." + name, part=0, fusion={"type": "Identity"}, position=position, owner=owner)


def _plan():
    # Two owners interleaved, mixed dtypes, one tensor larger than a bucket.
    entries, position = [], 0
    for i in range(12):
        shape = (1024, 300) if i == 5 else (64, 17 + i)
        entries.append(_entry(f"t{i}", shape, "bfloat16" if i % 3 == 0 else "float32", owner=i % 2, position=position))
        position += 1
    return WeightSyncPlan(entries=tuple(entries), trainer_world_size=2)


def _tensors(plan, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {e.name: torch.randn(e.shape, generator=generator).to(e.torch_dtype) for e in plan.entries}


def test_layout_covers_plan_once_respects_size_and_orders_by_readiness():
    plan = _plan()
    bucket_bytes = 16 * 1024
    buckets = layout_buckets(plan, bucket_bytes)
    names = [e.name for b in buckets for e in b.entries]
    assert sorted(names) == sorted(e.name for e in plan.entries)
    for bucket in buckets:
        assert len({e.owner for e in bucket.entries}) == 1
        assert bucket.payload_bytes <= bucket_bytes or len(bucket.entries) == 1
    big = next(b for b in buckets if any(e.name == "t5" for e in b.entries))
    assert len(big.entries) == 1 and big.payload_bytes > bucket_bytes
    ready = [b.ready_position for b in buckets]
    assert ready == sorted(ready)
    # Within an owner, plan order is kept.
    for owner in (0, 1):
        own = [e.position for b in buckets if b.owner == owner for e in b.entries]
        assert own == sorted(own)


def test_pack_unpack_round_trip_returns_copies():
    plan = _plan()
    tensors = _tensors(plan)
    (bucket, *_) = [b for b in layout_buckets(plan, MB) if b.owner == 0]
    buffer = allocate(bucket.buffer_bytes)
    pack(bucket, tensors, buffer, version=3, checksum="sum")
    out = dict(unpack(bucket, buffer, "sum", version=3))
    buffer.fill_(7)  # the buffer is reused for the next bucket
    assert sorted(out) == sorted(e.name for e in bucket.entries)
    for name, tensor in out.items():
        assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name]), name


@pytest.mark.parametrize("checksum", ["sum", "crc32"])
def test_corrupted_bucket_or_stale_version_is_refused(checksum):
    plan = _plan()
    tensors = _tensors(plan)
    bucket = layout_buckets(plan, MB)[0]
    buffer = allocate(bucket.buffer_bytes)
    pack(bucket, tensors, buffer, version=1, checksum=checksum)
    with pytest.raises(ChecksumMismatch, match="version"):
        list(unpack(bucket, buffer, checksum, version=2))
    buffer[5] += 1
    with pytest.raises(ChecksumMismatch, match="checksum"):
        list(unpack(bucket, buffer, checksum, version=1))


def test_pack_stream_waits_before_reusing_a_buffer_and_detects_missing_tensors():
    plan = _plan()
    tensors = _tensors(plan)
    mine = [b for b in layout_buckets(plan, 4096) if b.owner == 1]
    buffers = [allocate(max(b.buffer_bytes for b in mine)) for _ in range(2)]
    reused = []
    stream = [(e.name, tensors[e.name]) for e in plan.entries if e.owner == 1]
    seen = []
    for bucket, slot in pack_stream(stream, mine, buffers, 1, "sum", reused.append):
        seen.extend(name for name, _ in unpack(bucket, buffers[slot], "sum", 1))
    assert seen == [name for name, _ in stream]
    assert reused == [i % 2 for i in range(len(mine))]
    with pytest.raises(RuntimeError, match="ended before"):
        list(pack_stream(stream[:-1], mine, buffers, 1, "sum", lambda slot: None))


def test_receiver_streams_every_tensor_through_the_colocated_transport():
    plan = dataclasses.replace(_plan(), entries=tuple(dataclasses.replace(e, owner=0) for e in _plan().entries))
    tensors = _tensors(plan, seed=1)
    config = WeightSyncConfig(transport="colocated", bucket_size_mb=8 * 1024 / MB)
    buckets = layout_buckets(plan, config.bucket_bytes)
    buffers = [allocate(max(b.buffer_bytes for b in buckets)) for _ in range(2)]
    stream = ((b, buffers[slot]) for b, slot in pack_stream([(e.name, tensors[e.name]) for e in plan.entries], buckets, buffers, 1, "sum", lambda s: None))
    transport = ColocatedTransport()
    transport.bind(stream)
    receiver = WeightReceiver(plan, transport, config)
    received = list(receiver.receive())
    assert [n for n, _ in received] == [e.name for b in buckets for e in b.entries]
    for name, tensor in received:  # copies survive the sender's buffer reuse
        assert torch.equal(tensor, tensors[name]), name


def test_plan_json_round_trip_and_digest():
    plan = _plan()
    again = WeightSyncPlan.from_json(plan.to_json())
    assert again == plan and again.digest == plan.digest
    changed = dataclasses.replace(plan, entries=(dataclasses.replace(plan.entries[0], shape=(64, 18)),) + plan.entries[1:])
    assert changed.digest != plan.digest
    assert "pickle" not in plan.to_json()


@pytest.mark.parametrize(
    "kwargs, key",
    [({"transport": "carrier-pigeon"}, "transport"), ({"bucket_size_mb": 0}, "bucket_size_mb"),
     ({"checksum": "md5"}, "checksum"), ({"num_buffers": 0}, "num_buffers"), ({"verify": True, "verify_prompts": ()}, "verify_prompts")],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        WeightSyncConfig(**kwargs)


def test_verify_fails_loudly_beyond_tolerance():
    from megatron_gkd.weight_sync import WeightSyncMismatch, check_prompt_logprobs

    expected = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    assert check_prompt_logprobs(expected + 5e-5, expected, 1e-4, version=2) == pytest.approx(5e-5)
    with pytest.raises(WeightSyncMismatch, match="version 3"):
        check_prompt_logprobs(expected + torch.tensor([0.0, 2e-4, 0.0], dtype=torch.float64), expected, 1e-4, version=3)
    with pytest.raises(WeightSyncMismatch):
        check_prompt_logprobs(torch.full((3,), float("nan"), dtype=torch.float64), expected, 1e-4, version=3)

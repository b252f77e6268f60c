"""Bucket layout, packing, checksums and the plan's serialisation, on synthetic plans (no Megatron)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_gkd.weight_sync import (
    ChecksumMismatch,
    TensorSpec,
    WeightSyncConfig,
    WeightSyncPlan,
    layout_buckets,
)
from megatron_gkd.weight_sync.buckets import allocate, arena_views, as_bytes, fold_checksum, pack, pack_stream, unpack, unpack_arena

MB = 2**20


def _entry(name, shape, dtype="float32", owner=0, position=0, pp_rank=0, tp_dim=0, shards=(0, 1)):
    return TensorSpec(name=name, shape=tuple(shape), dtype=dtype, pp_rank=pp_rank, vpp_chunk=0, tp_dim=tp_dim,
                      tp_size=2 if tp_dim is not None else 1, expert=None, megatron="m." + name, part=0,
                      fusion={"type": "Identity"}, position=position, owner=owner, shards=tuple(shards))


def _plan():
    # Slices of two TP ranks along dim 0 and dim 1, replicated tensors owned by one rank, mixed dtypes,
    # one tensor larger than a bucket.
    entries = []
    for i in range(12):
        shape = (1024, 300) if i == 5 else (64, 18 + 2 * i)
        dtype = "bfloat16" if i % 3 == 0 else "float32"
        if i % 4 == 3:
            entries.append(_entry(f"t{i}", shape, dtype, owner=i % 2, position=i, tp_dim=None, shards=(i % 2,)))
        else:
            entries.append(_entry(f"t{i}", shape, dtype, owner=i % 2, position=i, tp_dim=i % 2))
    return WeightSyncPlan(entries=tuple(entries), trainer_world_size=2)


def _tensors(plan, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {e.name: torch.randn(e.shape, generator=generator).to(e.torch_dtype) for e in plan.entries}


def _slices(plan, tensors, rank=None):
    """``(name, shard, slice)`` as each rank's shard exporter yields them (all ranks, or ``rank``'s)."""
    out = []
    for entry in plan.entries:
        pieces = tensors[entry.name].chunk(entry.num_shards, dim=entry.tp_dim or 0)
        out.extend((entry.name, shard, pieces[shard]) for shard, holder in enumerate(entry.shards) if rank in (None, holder))
    return out


def _pack_bucket(bucket, plan, tensors, version, checksum):
    buffer = allocate(bucket.buffer_bytes)
    pending = {(name, shard): piece for name, shard, piece in _slices(plan, tensors)}
    for part in bucket.parts:
        pack(bucket, part, pending, part.region(buffer), version, checksum)
    return buffer


def test_layout_covers_plan_once_with_one_part_per_slice_holder():
    plan = _plan()
    bucket_bytes = 16 * 1024
    buckets = layout_buckets(plan, bucket_bytes)
    assert [e.name for b in buckets for e in b.entries] == [e.name for e in plan.entries]  # plan order
    assert [b.index for b in buckets] == list(range(len(buckets)))
    for bucket in buckets:
        assert bucket.payload_bytes <= bucket_bytes or len(bucket.entries) == 1
        assert [p.owner for p in bucket.parts] == sorted({r for e in bucket.entries for r in e.shards})
        held = sorted((bucket.entries[i].name, shard, part.owner) for part in bucket.parts for i, shard in part.slices)
        assert held == sorted((e.name, s, r) for e in bucket.entries for s, r in enumerate(e.shards))
        end = 0
        for part in bucket.parts:  # parts side by side, aligned, not overlapping
            assert part.start >= end and part.start % 16 == 0 and all(o % 16 == 0 for o in part.offsets)
            end = part.start + part.buffer_bytes
        assert bucket.buffer_bytes == end
    big = next(b for b in buckets if any(e.name == "t5" for e in b.entries))
    assert len(big.entries) == 1 and big.payload_bytes > bucket_bytes
    # Each rank sends only its share: a split tensor's bytes are divided between its holders.
    for bucket in buckets:
        for part in bucket.parts:
            shares = [bucket.entries[i].num_bytes // bucket.entries[i].num_shards for i, _ in part.slices]
            assert part.payload_bytes == sum((n + 15) // 16 * 16 for n in shares)


def test_pack_unpack_round_trip_assembles_slices_into_new_tensors():
    plan = _plan()
    tensors = _tensors(plan)
    bucket = layout_buckets(plan, MB)[0]
    buffer = _pack_bucket(bucket, plan, tensors, version=3, checksum="sum")
    out = dict(unpack(bucket, buffer, "sum", version=3))
    buffer.fill_(7)  # the buffer is reused for the next bucket
    assert list(out) == [e.name for e in bucket.entries]
    for name, tensor in out.items():
        assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name]), name


@pytest.mark.parametrize("checksum", ["sum", "crc32"])
def test_corrupted_part_or_stale_version_is_refused(checksum):
    plan = _plan()
    tensors = _tensors(plan)
    bucket = layout_buckets(plan, MB)[0]
    buffer = _pack_bucket(bucket, plan, tensors, version=1, checksum=checksum)
    with pytest.raises(ChecksumMismatch, match="version"):
        list(unpack(bucket, buffer, checksum, version=2))
    second = bucket.parts[1]
    buffer[second.start + 5] += 1
    with pytest.raises(ChecksumMismatch, match=f"rank {second.owner}.*checksum"):
        list(unpack(bucket, buffer, checksum, version=1))


def test_pack_stream_packs_one_ranks_parts_waits_before_reuse_and_detects_missing_slices():
    plan = _plan()
    tensors = _tensors(plan)
    mine = [(b, b.part_of(1)) for b in layout_buckets(plan, 4096) if b.part_of(1) is not None]
    buffers = [allocate(max(p.buffer_bytes for _, p in mine)) for _ in range(2)]
    reused = []
    stream = _slices(plan, tensors, rank=1)
    seen = []
    for bucket, part, slot in pack_stream(stream, mine, buffers, 1, "sum", reused.append):
        assert part.owner == 1
        region = buffers[slot][: part.buffer_bytes]
        for (i, shard), offset in zip(part.slices, part.offsets):
            entry = bucket.entries[i]
            got = region[offset:].view(entry.torch_dtype)[: torch.Size(bucket.slice_shape(entry)).numel()]
            seen.append((entry.name, shard, got.view(bucket.slice_shape(entry)).clone()))
    assert [(n, s) for n, s, _ in seen] == [(n, s) for n, s, _ in stream]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(seen, stream))
    assert reused == [i % 2 for i in range(len(mine))]
    with pytest.raises(RuntimeError, match="ended before"):
        list(pack_stream(stream[:-1], mine, buffers, 1, "sum", lambda slot: None))


def _fill_arena(bucket, plan, tensors, version, checksum):
    """What the direct transfer's broadcasts leave in a bucket's arena."""
    arena, scratch = allocate(bucket.arena_bytes), allocate(bucket.scratch_bytes)
    pending = {(name, shard): piece for name, shard, piece in _slices(plan, tensors)}
    for p, part in enumerate(bucket.parts):
        sent = [pending[bucket.slice_key(i, shard)].contiguous() for i, shard in part.slices]
        for (i, shard), tensor in zip(part.slices, sent):
            bucket.direct_slice(arena, scratch, i, shard).copy_(tensor)
        bucket.arena_trailer(arena, p).copy_(torch.tensor([fold_checksum(checksum, sent), version]))
    return arena, scratch


@pytest.mark.parametrize("checksum", ["sum", "crc32"])
def test_direct_arena_holds_every_tensor_in_hf_layout_and_refuses_corruption(checksum):
    plan = _plan()
    tensors = _tensors(plan)
    for bucket in layout_buckets(plan, 16 * 1024):
        arena, scratch = _fill_arena(bucket, plan, tensors, version=4, checksum=checksum)
        views = arena_views(bucket, arena, scratch)
        for i, (entry, (name, tensor)) in enumerate(zip(bucket.entries, unpack_arena(bucket, views, checksum, version=4))):
            assert name == entry.name and torch.equal(tensor, tensors[name]), name
            # Every tensor is a view of the arena; only slices along dim 1 went through scratch.
            assert tensor.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr(), name
            assert (bucket.scratch_offsets[i] is None) == (entry.num_shards == 1 or entry.tp_dim == 0), name
        scratch.fill_(3)  # reused for a later bucket: the tensors live in the arena
        assert all(torch.equal(bucket.arena_tensor(arena, i), tensors[e.name]) for i, e in enumerate(bucket.entries))
    bucket = layout_buckets(plan, MB)[0]
    arena, scratch = _fill_arena(bucket, plan, tensors, version=4, checksum=checksum)
    with pytest.raises(ChecksumMismatch, match="version 4, expected 5"):
        list(unpack_arena(bucket, arena_views(bucket, arena, scratch), checksum, version=5))
    i, shard = bucket.parts[1].slices[0]
    as_bytes(bucket.direct_slice(arena, scratch, i, shard))[3] += 1
    with pytest.raises(ChecksumMismatch, match=f"rank {bucket.parts[1].owner}.*checksum"):
        list(unpack_arena(bucket, arena_views(bucket, arena, scratch), checksum, version=4))


def test_checksums_fold_over_pieces_and_do_not_depend_on_alignment():
    data = torch.randint(0, 256, (1003,), dtype=torch.uint8)  # not a multiple of 8 bytes
    for checksum in ("sum", "crc32"):
        whole = fold_checksum(checksum, [data])
        assert fold_checksum(checksum, [data[:24], data[24:608], data[608:]]) == whole
        assert fold_checksum(checksum, [data[:24], data[25:]]) != whole
        # The receiver may hold a piece at an odd address of its arena, the sender in its own storage.
        piece = data[3:900]
        assert fold_checksum(checksum, [piece]) == fold_checksum(checksum, [piece.clone()])


def test_plan_json_round_trip_and_digest():
    plan = _plan()
    again = WeightSyncPlan.from_json(plan.to_json())
    assert again == plan and again.digest == plan.digest
    changed = dataclasses.replace(plan, entries=(dataclasses.replace(plan.entries[0], shape=(64, 20)),) + plan.entries[1:])
    assert changed.digest != plan.digest
    assert "pickle" not in plan.to_json()


@pytest.mark.parametrize(
    "kwargs, key",
    [({"transport": "carrier-pigeon"}, "transport"), ({"bucket_size_mb": 0}, "bucket_size_mb"),
     ({"checksum": "md5"}, "checksum"), ({"transfer": "zero-copy"}, "transfer"), ({"num_buffers": 0}, "num_buffers"),
     ({"verify": True, "verify_prompts": ()}, "verify_prompts")],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        WeightSyncConfig(**kwargs)


def test_auto_transfer_is_direct_over_host_memory_and_packed_elsewhere():
    import types

    config = WeightSyncConfig()
    assert config.resolved_transfer(types.SimpleNamespace(backend="gloo")) == "direct"
    from megatron_gkd import platform

    accelerator_backends = {known.dist_backend for known in platform.known_platforms() if known.dist_backend != "gloo"}
    assert len(accelerator_backends) == 2
    for backend in accelerator_backends:
        assert config.resolved_transfer(types.SimpleNamespace(backend=backend)) == "packed"
    assert WeightSyncConfig(transfer="packed").resolved_transfer(types.SimpleNamespace(backend="gloo")) == "packed"


def test_verify_fails_loudly_beyond_tolerance():
    from megatron_gkd.weight_sync import WeightSyncMismatch, check_prompt_logprobs

    expected = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    assert check_prompt_logprobs(expected + 5e-5, expected, 1e-4, version=2) == pytest.approx(5e-5)
    with pytest.raises(WeightSyncMismatch, match="version 3"):
        check_prompt_logprobs(expected + torch.tensor([0.0, 2e-4, 0.0], dtype=torch.float64), expected, 1e-4, version=3)
    with pytest.raises(WeightSyncMismatch):
        check_prompt_logprobs(torch.full((3,), float("nan"), dtype=torch.float64), expected, 1e-4, version=3)


def test_bucket_groups_use_the_transport_backend_and_control_stays_on_gloo(monkeypatch):
    import torch.distributed as dist

    from megatron_gkd import platform
    from megatron_gkd.testing.distributed import free_port
    from megatron_gkd.weight_sync import TorchDistributedTransport

    built = []
    monkeypatch.setitem(platform.PROCESS_GROUP_BUILDERS, "accel", lambda store, rank, size, timeout: built.append((rank, size)) or "group")
    monkeypatch.setattr(platform, "device", lambda: torch.device("cpu"))  # where an accelerator's buffers would go
    transport = TorchDistributedTransport(address="127.0.0.1", port=free_port(), rank=0, num_trainer_ranks=1,
                                          num_rollout_ranks=0, backend="accel", timeout_s=30)
    assert isinstance(transport.world, dist.ProcessGroupGloo)  # handshake, barriers, verify log-probs
    transport.connect([0])
    assert transport.group_of(0) == "group" and built == [(0, 1)]
    transport.close()

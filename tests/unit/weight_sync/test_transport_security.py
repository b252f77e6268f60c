"""The weight-sync rendezvous and bucket checksums under an attacker on the network (issue 14, item 8).

* The rendezvous store and the group's own sockets listen on the configured interface only (the store
  listened on every interface, even when given 127.0.0.1).
* With the run's secret, a process that reaches the store but does not hold the secret cannot pose as
  a rank: every value a rank publishes is signed, and an unsigned or wrongly signed one is refused.
* ``checksum="blake3"`` keyed with the secret authenticates each bucket part, its version, bucket and
  sender: a forger who rewrites a part and its trailer passes the fast sum but not the keyed hash.
"""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_gkd.testing.distributed import free_port
from megatron_gkd.weight_sync import ChecksumMismatch, TensorSpec, TorchDistributedTransport, WeightSyncPlan, layout_buckets
from megatron_gkd.weight_sync.buckets import allocate, fold_checksum, pack, unpack

SECRET = b"0123456789abcdef-run-secret"


def _listening_sockets() -> dict[str, str]:
    """inode -> local address (hex, as /proc/net shows it) of every listening TCP socket of this process."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as stream:
            for line in stream.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in mine:
                    listening[fields[9]] = fields[1].rsplit(":", 1)[0]
    return listening


def test_the_rendezvous_and_the_group_listen_on_the_configured_interface_only():
    before = _listening_sockets()
    transport = TorchDistributedTransport(address="127.0.0.1", port=free_port(), rank=0, num_trainer_ranks=1,
                                          num_rollout_ranks=0, timeout_s=30)
    opened = {inode: address for inode, address in _listening_sockets().items() if inode not in before}
    transport.close()
    assert opened  # the store, and gloo's listener
    loopback = ("0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000")
    assert all(address in loopback for address in opened.values()), opened


def _rank0_with_secret(port: int, outcome: list) -> None:
    try:
        TorchDistributedTransport(address="127.0.0.1", port=port, rank=0, num_trainer_ranks=1, num_rollout_ranks=1,
                                  timeout_s=10, idle_timeout_s=10, secret=SECRET)
        outcome.append("joined")
    except Exception as error:  # noqa: BLE001 - the test inspects it
        outcome.append(error)


@pytest.mark.parametrize("impostor_secret", [None, b"another-secret-of-the-same-size"], ids=["no-secret", "wrong-secret"])
def test_a_joiner_without_the_runs_secret_cannot_pose_as_a_rank(impostor_secret):
    from megatron_gkd.weight_sync.transports import SignedStore

    port, outcome = free_port(), []
    rank0 = threading.Thread(target=_rank0_with_secret, args=(port, outcome))
    rank0.start()
    impostor = dist.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=10))
    if impostor_secret is not None:
        impostor = SignedStore(impostor, impostor_secret)
    # What rank 1 would publish for gloo's rendezvous: rank 0 would connect to the address in it.
    impostor.set("weight_sync/all/0/1", b"\x02\x00\x30\x39\x7f\x00\x00\x01" + bytes(120))
    rank0.join(timeout=60)
    assert len(outcome) == 1 and isinstance(outcome[0], PermissionError), outcome
    assert "weight_sync/all/0/1" in str(outcome[0]) and "secret" in str(outcome[0])


def test_secrets_shorter_than_16_bytes_are_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        TorchDistributedTransport(address="127.0.0.1", port=free_port(), rank=0, num_trainer_ranks=1,
                                  num_rollout_ranks=0, secret=b"short")


def _plan():
    entries = tuple(
        TensorSpec(name=f"t{i}", shape=(64, 32), dtype="float32", pp_rank=0, vpp_chunk=0, tp_dim=None, tp_size=1,
                   expert=None, megatron=f"m.t{i}", part=0, fusion={"type": "Identity"}, position=i, owner=i % 2,
                   shards=(i % 2,))
        for i in range(4)
    )
    return WeightSyncPlan(entries=entries, trainer_world_size=2)


def _packed(bucket, tensors, version, checksum, key):
    buffer = allocate(bucket.buffer_bytes)
    for part in bucket.parts:
        pack(bucket, part, tensors, part.region(buffer), version, checksum, key=key)
    return buffer


def _forge(bucket, buffer, version, forged_checksum):
    """What a forger on the wire can do: change a part's payload and rewrite its trailer to match."""
    part = bucket.parts[1]
    region = part.region(buffer)
    region[: part.payload_bytes].view(torch.float32)[0] = 1e6
    trailer = region[part.payload_bytes :].view(torch.int64)
    trailer[0] = fold_checksum(forged_checksum, [region[: part.payload_bytes]])
    trailer[1] = version


def test_keyed_blake3_refuses_forged_and_replayed_parts_that_the_fast_sum_accepts():
    plan = _plan()
    (bucket,) = layout_buckets(plan, 2**20)
    tensors = {(e.name, 0): torch.randn(e.shape) for e in plan.entries}
    key = b"k" * 32

    forged = _packed(bucket, tensors, 3, "sum", None)
    _forge(bucket, forged, 3, "sum")
    assert dict(unpack(bucket, forged, "sum", version=3))["t1"][0, 0] == 1e6  # accepted: a sum is no MAC

    forged = _packed(bucket, tensors, 3, "blake3", key)
    _forge(bucket, forged, 3, "blake3")  # the forger knows the algorithm but not the key
    with pytest.raises(ChecksumMismatch, match="rank 1.*checksum"):
        list(unpack(bucket, forged, "blake3", version=3, key=key))

    # Replay: an old version's bytes, relabelled as the new version.
    replayed = _packed(bucket, tensors, 2, "blake3", key)
    for part in bucket.parts:
        part.region(replayed)[part.payload_bytes :].view(torch.int64)[1] = 3
    with pytest.raises(ChecksumMismatch, match="checksum"):
        list(unpack(bucket, replayed, "blake3", version=3, key=key))
    intact = _packed(bucket, tensors, 3, "blake3", key)
    assert all(torch.equal(t, tensors[n, 0]) for n, t in unpack(bucket, intact, "blake3", version=3, key=key))
    with pytest.raises(ChecksumMismatch):  # the receiver holds another key
        list(unpack(bucket, intact, "blake3", version=3, key=b"x" * 32))

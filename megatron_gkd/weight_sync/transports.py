"""How bucket bytes travel from the trainer to the rollout ranks (registry by name).

``distributed``
    A dedicated process group between the trainer ranks and the rollout ranks, built from its own
    TCP store (the trainer's torchrun world and the rollout processes need not share a default
    group). Each sending rank gets a group with just the rollout ranks, so a bucket part is one
    broadcast from its sender, the parts of a bucket travel at once, and ranks that send nothing take
    no part. Operations are asynchronous: a sender packs its part of bucket i+1 while bucket i is on
    the wire, a receiver posts bucket i+1 before unpacking i.
``colocated``
    The sender and the receiver are in one process: nothing is broadcast, and no buckets are packed
    (:mod:`megatron_gkd.weight_sync.colocated`).

A sync is framed on the control group (gloo, every rank): :meth:`begin` carries the version from
trainer rank 0 (the rollout ranks wait for it between syncs, up to ``idle_timeout_s``), the buckets
follow, and :meth:`agree` tells every rank whether every rollout rank took the version. Once begun,
each operation must finish within ``timeout_s``: a sender that dies or hangs mid-sync fails the sync
after that long instead of blocking the rollout ranks.

Security (``SECURITY.md``): the rendezvous store and the gloo groups
listen on the configured interface only; with the run's ``secret`` every value published in the store
is signed, so a process that reaches the store without the secret cannot pose as a rank, and
``checksum="blake3"`` authenticates each bucket part with a key derived from it.
"""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import logging
import socket

import blake3
import torch
import torch.distributed as dist

from megatron_gkd import platform
from megatron_gkd.registry import Registry
from megatron_gkd.weight_sync.buckets import BucketSpec, PartSpec
from megatron_gkd.weight_sync.errors import WeightSyncTransportError

logger = logging.getLogger(__name__)

TRANSPORTS: Registry[type] = Registry("weight-sync transport", config_key="weight_sync.transport")

MIN_SECRET_BYTES = 16
_STORE_KEY_CONTEXT = "megatron-gkd weight-sync rendezvous store signatures v1"
_BUCKET_KEY_CONTEXT = "megatron-gkd weight-sync bucket checksums v1"
_TAG_BYTES = 32


def register_transport(name: str):
    """Class decorator registering a transport under ``name``."""
    return TRANSPORTS.register(name)


def get_transport(name: str) -> type:
    return TRANSPORTS.get(name)


def derive_key(secret: bytes, context: str) -> bytes:
    """A 32-byte key for one purpose (``context``) from the run's secret (blake3's key derivation)."""
    return blake3.blake3(secret, derive_key_context=context).digest()


def _check_secret(secret: bytes | str | None, address: str) -> bytes | None:
    if secret is None:
        if not _is_loopback(address):
            logger.warning(
                "the weight-sync rendezvous on %s has no secret: any process that reaches it can join the "
                "run's group; pass the run's secret (secret=...) and use checksum='blake3'", address)
        return None
    secret = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the weight-sync secret has {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES} bytes "
                         "of random data (e.g. `openssl rand -hex 32`)")
    return secret


def _is_loopback(address: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(address, None))
    except (OSError, ValueError):
        return False


class SignedStore(dist.Store):
    """A c10d store whose values carry a keyed blake3 tag of (key, value) with a key derived from the
    run's secret; a value without a valid tag is refused (``PermissionError``) where it is read.

    Gloo's rendezvous publishes each rank's address in the store and connects to what it reads: with
    signed values, a process that reaches the store without the secret (or with another one) cannot
    make a rank connect to it. It can still read values (addresses are not secret) and overwrite or
    delete them, which fails the rendezvous loudly. Counters (``add``) are not signed; the groups here
    do not rely on them.
    """

    def __init__(self, inner: dist.Store, secret: bytes):
        super().__init__()
        self._inner = inner
        self._key = derive_key(secret, _STORE_KEY_CONTEXT)

    def _tag(self, key: str, value: bytes) -> bytes:
        hasher = blake3.blake3(key=self._key)
        encoded = key.encode()
        hasher.update(len(encoded).to_bytes(8, "little") + encoded + value)
        return hasher.digest(_TAG_BYTES)

    def set(self, key, value):
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self._tag(key, value) + value)

    def get(self, key):
        raw = bytes(self._inner.get(key))
        tag, value = raw[:_TAG_BYTES], raw[_TAG_BYTES:]
        if len(raw) < _TAG_BYTES or not hmac.compare_digest(tag, self._tag(key, value)):
            raise PermissionError(
                f"weight-sync rendezvous: the value of {key!r} is not signed with this run's secret (a process "
                "without the secret wrote it, or the ranks were given different secrets)")
        return value

    def wait(self, keys, timeout=None):
        return self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)

    def check(self, keys):
        return self._inner.check(keys)

    def add(self, key, amount):
        return self._inner.add(key, amount)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    def set_timeout(self, timeout):
        self._inner.set_timeout(timeout)


def _open_store(address: str, port: int, size: int, is_master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store; the master listens on ``address`` only (``TCPStore`` alone listens on every
    interface, whatever host name it is given)."""
    if not is_master:
        return dist.TCPStore(address, port, size, False, timeout)
    family, kind, protocol, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, protocol)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    # The store takes the socket over (and closes it).
    return dist.TCPStore(address, port, size, True, timeout, master_listen_fd=listener.detach())


def _local_address_towards(address: str, port: int) -> str:
    """The local address this host reaches ``address`` from (the interface gloo should listen on)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)  # a datagram socket sends nothing on connect: the kernel picks the route
        return probe.getsockname()[0]


class _Pending:
    """Asynchronous operations on one buffer (the parts of a bucket); a failure of any of them (a
    timeout, a closed connection) raises :class:`WeightSyncTransportError` and breaks ``transport``."""

    def __init__(self, works, buffer: torch.Tensor, transport=None):
        self.works = works
        self.buffer = buffer
        self.transport = transport

    def wait(self) -> bool:
        try:
            for work in self.works:
                work.wait()
        except Exception as error:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
            if self.transport is None:
                raise
            raise self.transport.broke(error) from error
        return True


@register_transport("distributed")
class TorchDistributedTransport:
    """A dedicated group: trainer ranks ``0..T-1`` (their trainer rank), rollout ranks ``T..T+R-1``.

    Args:
        address, port: the TCP store of this group (sync rank 0, the first trainer rank, hosts it and
            listens on ``address`` only).
        rank: this process's rank in the group.
        num_trainer_ranks: T; num_rollout_ranks: R.
        backend: of the bucket groups (the data); default: the platform's (gloo on the host, nccl on
            CUDA, hccl on Ascend). The handshake, the framing of each sync and verify log-probs always
            travel over gloo.
        timeout_s: once a sync has begun, each of its operations (and the bucket groups' operations)
            must finish within this: a sender that dies or hangs mid-sync fails the sync (and leaves
            the engines stale) after about this long.
        idle_timeout_s: the rendezvous, and waiting on the control group between syncs (the rollout
            ranks wait for the next sync while the trainers train; the disaggregated rollout server
            waits there for requests).
        secret: the run's shared secret (at least 16 bytes): signs the rendezvous (joiners without it
            are refused) and keys ``checksum="blake3"``. Without one, a non-loopback ``address`` is
            warned about.
        bind_address: the local address the gloo groups listen on; default: the one this host reaches
            ``address`` from (loopback for a loopback ``address``).
    """

    def __init__(self, *, address: str, port: int, rank: int, num_trainer_ranks: int, num_rollout_ranks: int,
                 backend: str | None = None, timeout_s: float = 60.0, idle_timeout_s: float = 1800.0,
                 secret: bytes | str | None = None, bind_address: str | None = None):
        if not 0 <= rank < num_trainer_ranks + num_rollout_ranks:
            raise ValueError(f"weight sync rank {rank} outside [0, {num_trainer_ranks + num_rollout_ranks})")
        if not (timeout_s > 0 and idle_timeout_s > 0):
            raise ValueError(f"weight sync timeouts must be positive, got timeout_s={timeout_s}, idle_timeout_s={idle_timeout_s}")
        secret = _check_secret(secret, address)
        self.rank = rank
        self.num_trainer_ranks = num_trainer_ranks
        self.rollout_ranks = list(range(num_trainer_ranks, num_trainer_ranks + num_rollout_ranks))
        self.backend = backend or platform.dist_backend()
        self.device = torch.device("cpu") if self.backend == "gloo" else platform.device()
        """Where bucket buffers and the receive arena live."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.idle_timeout = datetime.timedelta(seconds=idle_timeout_s)
        self.bucket_key = derive_key(secret, _BUCKET_KEY_CONTEXT) if secret else None
        """Key of ``checksum="blake3"`` (``None`` without a secret: an unkeyed hash)."""
        self.bind_address = bind_address or _local_address_towards(address, port)
        self.broken: str | None = None
        """Why the transport cannot be used any more (a failed operation), or ``None``."""
        size = num_trainer_ranks + num_rollout_ranks
        self._tcp_store = _open_store(address, port, size, rank == 0, self.idle_timeout)
        # Kept referenced: the groups call back into the Python store.
        self._store = SignedStore(self._tcp_store, secret) if secret else self._tcp_store
        self.world = self._new_group("gloo", "all", rank, size, self.idle_timeout)
        self._owner_groups: dict[int, object] = {}

    def _new_group(self, backend: str, name: str, rank: int, size: int, timeout: datetime.timedelta):
        store = dist.PrefixStore(f"weight_sync/{name}", self._store)
        return platform.new_process_group(backend, store, rank, size, timeout, bind_address=self.bind_address)

    def connect(self, owners: list[int]) -> None:
        """Builds one group per sending rank (it and the rollout ranks); every member calls it."""
        for owner in owners:
            members = [owner, *self.rollout_ranks]
            if self.rank in members:
                self._owner_groups[owner] = self._new_group(self.backend, f"owner{owner}", members.index(self.rank),
                                                            len(members), self.timeout)

    def broke(self, error: BaseException) -> WeightSyncTransportError:
        """Records that an operation failed; the error to raise."""
        self.broken = f"{type(error).__name__}: {error}"
        return WeightSyncTransportError(
            f"weight-sync transport failed ({self.broken}); operations time out after "
            f"{self.timeout.total_seconds():g} s (timeout_s); build a new transport to sync again")

    def begin(self, version: int | None) -> int:
        """Starts a sync on every rank: trainer rank 0's ``version`` (rollout ranks pass ``None``)."""
        if self.broken is not None:
            raise WeightSyncTransportError(f"weight-sync transport failed earlier ({self.broken}); build a new one")
        header = torch.tensor([-1 if version is None else int(version)], dtype=torch.int64)
        _Pending([self.world.broadcast(header, 0)], header, self).wait()
        return int(header[0])

    def agree(self, ok: bool) -> bool:
        """Ends a sync: whether every rank's part went well (within ``timeout_s``)."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        options.timeout = self.timeout
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        _Pending([self.world.allreduce([flag], options)], flag, self).wait()
        return bool(flag[0])

    def share_text(self, text: str | None, src: int = 0) -> str:
        """``text`` of rank ``src`` on every rank of the group (the plan handshake)."""
        length = torch.tensor([len(text.encode()) if self.rank == src else 0], dtype=torch.int64)
        self.world.broadcast(length, src).wait()
        data = torch.empty(int(length), dtype=torch.uint8)
        if self.rank == src:
            data.copy_(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8))
        self.world.broadcast(data, src).wait()
        return bytes(data.numpy()).decode()

    def share_tensor(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.world.broadcast(tensor, src).wait()
        return tensor

    def group_of(self, owner: int):
        """The group of ``owner`` and the rollout ranks (owner is its rank 0)."""
        return self._owner_groups[owner]

    def barrier(self) -> None:
        self.world.broadcast(torch.zeros(1), 0).wait()

    def send(self, part: PartSpec, buffer: torch.Tensor):
        """Broadcasts this rank's ``part`` (packed at the start of ``buffer``) to the rollout ranks."""
        return _Pending([self._owner_groups[part.owner].broadcast(buffer[: part.buffer_bytes], 0)], buffer, self)

    def post(self, owner: int, tensors: list[torch.Tensor], buffer: torch.Tensor | None = None):
        """Direct transfer: broadcasts ``tensors`` (contiguous) from ``owner`` to the rollout ranks, in
        order (the receivers post tensors of the same sizes in the same order)."""
        group = self._owner_groups[owner]
        return _Pending([group.broadcast(tensor, 0) for tensor in tensors], buffer, self)

    def recv(self, bucket: BucketSpec, buffer: torch.Tensor):
        """Posts every part of ``bucket`` at once, each into its region of ``buffer``."""
        works = [self._owner_groups[part.owner].broadcast(part.region(buffer), 0) for part in bucket.parts]
        return _Pending(works, buffer, self)

    def close(self) -> None:
        self._owner_groups.clear()
        self.world = None
        self._store = self._tcp_store = None


@register_transport("colocated")
class ColocatedTransport:
    """``weight_sync.transport=colocated``: the trainer rank holds the engine and nothing travels;
    :func:`~megatron_gkd.weight_sync.colocated.colocated_sync` streams the gathered tensors into it."""

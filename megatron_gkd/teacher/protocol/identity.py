"""Which model a teacher worker serves: a cheap fingerprint of its checkpoint, and the INFO fields that
must agree between replicas behind one proxy.

A full hash of a large teacher's weights (1.3 TB for DeepSeek-V3) would take minutes at every worker
start; the fingerprint reads 16 evenly spaced 64 KiB blocks of each file instead (1 MiB a file),
with every file's name and size. Two checkpoints of one shape with other weights (another seed,
another fine-tune) differ in every block that holds weights; what it cannot tell apart is a checkpoint
edited in bytes it does not read, which the teacher cache's full digest (``cache/store.py``) covers
where it matters.
"""

from __future__ import annotations

import os
import pathlib

import blake3

_BLOCKS, _BLOCK_BYTES = 16, 64 * 2**10

# BackendInfo fields that replicas of one teacher share; the rest (max_top_k, names of hosts) may differ.
IDENTITY_FIELDS = ("name", "model_digest", "dtype", "vocab_size", "tokenizer_size", "tokenizer_digest",
                   "signals", "hidden_size", "supports_temperature", "supports_requested_ids")


def _positive_int(value) -> bool:
    return type(value) is int and value >= 1  # type(), not isinstance: True is an int to Python


# What each INFO field must hold: a client bounds the ids it accepts by ``tokenizer_size`` and sends generate requests
# when ``supports_generate`` says so, so a string or a 1 where a number or a bool belongs must be refused, not used.
_INFO_TYPES = {
    "name": ("a string", lambda v: isinstance(v, str)),
    "vocab_size": ("a positive int", _positive_int),
    "tokenizer_size": ("a positive int or None", lambda v: v is None or _positive_int(v)),
    "tokenizer_digest": ("a string or None", lambda v: v is None or isinstance(v, str)),
    "max_top_k": ("a positive int", _positive_int),
    "supports_requested_ids": ("a bool", lambda v: type(v) is bool),
    "supports_temperature": ("a bool", lambda v: type(v) is bool),
    "supports_generate": ("a bool", lambda v: type(v) is bool),
    "max_sequence_length": ("a positive int or None", lambda v: v is None or _positive_int(v)),
    "hidden_size": ("a positive int or None", lambda v: v is None or _positive_int(v)),
    "signals": ("a list of signal names", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v)),
    "model_digest": ("a string or None", lambda v: v is None or isinstance(v, str)),
    "dtype": ("a string or None", lambda v: v is None or isinstance(v, str)),
}


def info_problems(info: dict) -> list[str]:
    """``field=value must be ...`` for each field of an INFO (``BackendInfo.to_dict()``) of the wrong type; fields
    it does not hold (a server older than them) are not checked."""
    return [f"{field}={info[field]!r} must be {what}" for field, (what, valid) in _INFO_TYPES.items()
            if field in info and not valid(info[field])]


def checkpoint_fingerprint(directory: str | os.PathLike) -> str | None:
    """blake3 over every file of ``directory`` (relative name, size and 16 sampled blocks), sorted by
    name; None when ``directory`` is not a local directory (a model name a backend resolves itself)."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return None
    hasher = blake3.blake3()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        size = path.stat().st_size
        hasher.update(f"{path.relative_to(directory).as_posix()}\0{size}\0".encode())
        with open(path, "rb") as handle:
            for index in range(_BLOCKS):
                handle.seek(max(0, size - _BLOCK_BYTES) * index // (_BLOCKS - 1))
                hasher.update(handle.read(_BLOCK_BYTES))
    return hasher.hexdigest()


def identity(info: dict) -> dict:
    """The fields of an INFO (``BackendInfo.to_dict()``) that replicas of one teacher must share."""
    return {field: info.get(field) for field in IDENTITY_FIELDS}


def differences(first: dict, other: dict) -> list[str]:
    """``field: first -> other`` for each identity field in which two INFOs differ."""
    a, b = identity(first), identity(other)
    return [f"{field}: {a[field]!r} -> {b[field]!r}" for field in IDENTITY_FIELDS if a[field] != b[field]]

"""Checkpoint paths -> HF directories: :func:`resolve_checkpoint`, which every reader of a checkpoint path calls.

An HF directory (or a Hub id, or any path that is not a GGUF) comes back unchanged. A GGUF file, or a directory
holding exactly one (:func:`megatron_gkd.planning.gguf_config.gguf_file`), comes back as the HF directory it converts
to (:mod:`megatron_gkd.models.gguf`), dequantized to the caller's dtype, kept in a cache:

    ``$MEGATRON_GKD_CACHE/gguf/<blake3 of the file, 32 hex digits>/<float32|bfloat16|float16|tokenizer>/``

(``$MEGATRON_GKD_CACHE`` defaults to ``${XDG_CACHE_HOME:-~/.cache}/megatron_gkd``). The key is the file's content:
a second run, or another path to the same bytes, reuses the conversion; an edited file gets a new one. ``tokenizer``
entries hold the config and tokenizer only, for readers that need no weights. Nothing is evicted: delete old
entries to reclaim the space (a 135M-parameter model is ~540 MB in float32).

Concurrent processes (the ranks of a run, a teacher service beside them) convert a file once: each takes an exclusive
``flock`` on ``<hash>/.lock``; the first converts, the others wait and then find the entry. A conversion writes into
``<entry>.partial.<host>.<pid>`` and renames it into place, so a reader never sees a half-written directory, also on a
shared file system where two hosts may both convert (the second rename loses and its copy is dropped). A partial
directory left by a killed conversion on this host is removed by the next one, which holds the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import pathlib
import shutil
import socket
import time

import blake3
import torch
from tqdm import tqdm

from megatron_gkd.models.gguf import convert_gguf, dtype_name
from megatron_gkd.planning.gguf_config import gguf_file

logger = logging.getLogger(__name__)

CACHE_ENV = "MEGATRON_GKD_CACHE"
TOKENIZER_ONLY = "tokenizer"
MARKER = "gguf_source.json"
_HASH_HEX = 32  # 128 bits of the blake3 digest name an entry
_CHUNK = 64 * 2**20
_PROGRESS_BYTES = 2**30  # files at least this large show a progress bar while hashed
# (real path, size, mtime_ns) -> digest: the readers of one process resolve a path several times (tokenizer,
# student, rollout engine); a change of size or mtime hashes again.
_HASHES: dict[tuple[str, int, int], str] = {}


def cache_root() -> pathlib.Path:
    """``$MEGATRON_GKD_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/megatron_gkd``: converted checkpoints and
    downloads (recipes) live under it."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return pathlib.Path(configured).expanduser()
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "megatron_gkd"


def resolve_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype | str | None = None) -> str:
    """The HF directory to read for the checkpoint ``path`` (see the module docstring).

    Args:
        path: an HF checkpoint directory, a GGUF file, a directory holding one GGUF file, or a Hub id.
        dtype: for a GGUF, what its weights are dequantized to (``float32``, ``bfloat16``, ``float16``; give the
            dtype the reader loads in, so that one conversion serves it); None: the config and tokenizer only.

    Returns:
        ``path`` itself (as a string) unless it names a GGUF; else the converted directory in the cache.

    Raises:
        ValueError: a malformed GGUF path or an unsupported dtype (the message has the fix).
        ImportError: a GGUF without the ``gguf``/``accelerate`` packages (the message says what to install).
    """
    file = gguf_file(path)
    if file is None:
        return os.fspath(path)
    kind = dtype_name(dtype) if dtype is not None else TOKENIZER_ONLY
    digest = file_blake3(file)
    root = gguf_cache_dir() / digest
    entry = root / kind
    if not entry.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        with exclusive(root / ".lock", f"converts {file}"):
            if not entry.is_dir():  # another process may have converted it while this one waited
                _convert(file, entry, dtype, digest)
    logger.debug("checkpoint %s is the GGUF conversion %s", path, entry)
    return str(entry)


def gguf_cache_dir() -> pathlib.Path:
    """Where GGUF conversions live: ``<cache_root()>/gguf``."""
    return cache_root() / "gguf"


def file_blake3(file: str | os.PathLike) -> str:
    """The first 32 hex digits of the blake3 digest of ``file``'s bytes (remembered per path, size and mtime)."""
    real = os.path.realpath(file)
    stat = os.stat(real)
    key = (real, stat.st_size, stat.st_mtime_ns)
    if key not in _HASHES:
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        with open(real, "rb") as handle, tqdm(total=stat.st_size, unit="B", unit_scale=True, desc=f"hashing {file}",
                                              disable=stat.st_size < _PROGRESS_BYTES) as progress:
            while chunk := handle.read(_CHUNK):
                hasher.update(chunk)
                progress.update(len(chunk))
        _HASHES[key] = hasher.hexdigest()[:_HASH_HEX]
    return _HASHES[key]


@contextlib.contextmanager
def exclusive(lock_file: str | os.PathLike, what: str):
    """Holds an exclusive ``flock`` on ``lock_file`` (created if missing; the kernel releases it if this process dies),
    logging that it waits for another process that ``what`` when one holds it."""
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that %s", what)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(file: str, entry: pathlib.Path, dtype, digest: str) -> None:
    """Converts into a partial directory and renames it to ``entry`` (call with the lock held)."""
    host = socket.gethostname()
    # This host's conversions of this file hold the lock we hold: a partial directory of this host is a dead one's.
    for stale in entry.parent.glob(f"{entry.name}.partial.{host}.*"):
        logger.warning("removing %s, left by a conversion that did not finish", stale)
        shutil.rmtree(stale, ignore_errors=True)
    partial = entry.with_name(f"{entry.name}.partial.{host}.{os.getpid()}")
    logger.info("converting GGUF %s (%.0f MB) into %s (%s)", file, os.path.getsize(file) / 2**20, entry, entry.name)
    start = time.perf_counter()
    try:
        convert_gguf(file, partial, dtype=dtype)
        (partial / MARKER).write_text(json.dumps({"format": "gguf", "blake3": digest, "dtype": entry.name}) + "\n")
        try:
            os.rename(partial, entry)
        except OSError:
            if not entry.is_dir():
                raise
            logger.info("%s was written by another host meanwhile; using it", entry)  # a shared file system
            shutil.rmtree(partial, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", file, time.perf_counter() - start)

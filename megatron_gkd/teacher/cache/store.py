"""The teacher cache's files: safetensors shards of teacher outputs, a JSON manifest, and the digests that
tie them to one teacher, tokenizer and dataset.

A cache directory holds ``shard-NNNNN.safetensors`` files and, once complete, ``manifest.json``. Shard
``i`` holds records ``i * records_per_shard ...`` of the dataset in its order; its tensors, concatenated
over its records (``N`` response rows, ``n`` records):

- ``digest`` ``[n, 32]`` uint8: :func:`sequence_digest` of each record's request (the lookup key);
- ``record_index`` ``[n]`` int64: the record's row in its file;
- ``offsets`` ``[n + 1]`` int64: record ``j`` owns rows ``offsets[j]:offsets[j + 1]``;
- ``token_logprobs`` ``[N]`` float32;
- top-k signal: ``topk_ids`` ``[N, k]`` int32 and ``topk_logprobs`` ``[N, k]`` float32, as the teacher
  sent them (float32: the losses must equal the live teacher's, so nothing is rounded; ids fit int32);
- hidden signal: ``hidden`` ``[N, h]`` in the requested ``hidden_dtype`` (the values already travelled in
  that dtype, so storing them in it loses nothing).

A cache of teacher-written responses (``manifest.generation`` set; :mod:`.generated`) holds, per prompt of the
dataset, ``num_per_prompt`` records of prompt + response (shard ``i`` holds prompts ``i * records_per_shard ...``,
each with its responses in the order the teacher wrote them), and two more tensors:

- ``prompt_digest`` ``[n, 32]`` uint8: :func:`sequence_digest` of each record's prompt alone (``response_start`` =
  its length): the key a generate request's prompt is looked up by;
- ``response_ids`` ``[N]`` int32: the response's ids, row for row with ``token_logprobs``.

Files carry no timestamps and at most one metadata key (safetensors writes several keys in a random
order), so the same build writes the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import pathlib
from typing import Any, Iterable

import blake3
import numpy as np
import torch

from megatron_gkd.planning.gguf_config import gguf_file
from megatron_gkd.teacher.protocol.security import MIN_SECRET_BYTES, SECRET_ENV
from megatron_gkd.teacher.protocol.types import Signal, TeacherOutput

logger = logging.getLogger(__name__)

FORMAT = "megatron-gkd-teacher-cache"
VERSION = 2
"""2 added the manifest's ``mac``; version 1 manifests (no MAC) are still read, as unverified ones."""
READABLE_VERSIONS = (1, 2)
MAC_CONTEXT = b"megatron-gkd teacher cache manifest\0"
"""Prefixed to what a manifest's MAC covers, so that nothing else signed with the run's secret passes for a
manifest (the teacher protocol's MACs cover frames that start with an 8-byte length, which these bytes are not)."""
MANIFEST = "manifest.json"
PLAN = "build.json"
"""Written when a build starts and removed when it completes: a restart must be the same build."""
SHARD_METADATA_KEY = "megatron_gkd_teacher_cache"
HIDDEN_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


def sequence_digest(token_ids: np.ndarray, response_start: int) -> bytes:
    """blake3 of ``(response_start, token_ids)`` as little-endian int64: the key a request is looked up by."""
    hasher = blake3.blake3()
    hasher.update(np.int64(response_start).astype("<i8").tobytes())
    hasher.update(np.ascontiguousarray(token_ids, dtype="<i8").tobytes())
    return hasher.digest()


@dataclasses.dataclass(frozen=True, slots=True)
class CacheRecord:
    """One prompt + response of the dataset, as the trainer sends it to the teacher."""

    index: int
    token_ids: np.ndarray
    response_start: int


def dataset_records(dataset) -> list[CacheRecord]:
    """The records of a :class:`~megatron_gkd.data.PromptDataset` (loaded with responses) as teacher requests:
    ``prompt_ids + response_ids`` with the response starting after the prompt, as the off-policy trainer
    builds its samples."""
    records = []
    for position in range(len(dataset)):
        record = dataset[position]
        if record.response_ids is None:
            raise ValueError(f"record {record.index} of {dataset.path} has no response: a teacher cache scores "
                             "reference responses (load the data with require_responses=True)")
        tokens = np.asarray(record.prompt_ids + record.response_ids, dtype=np.int64)
        records.append(CacheRecord(index=record.index, token_ids=tokens, response_start=len(record.prompt_ids)))
    return records


def dataset_digest(records: Iterable[CacheRecord]) -> str:
    """blake3 of the records as tokenized, in order (row index, response start, length, token ids)."""
    hasher = blake3.blake3()
    for record in records:
        hasher.update(np.asarray([record.index, record.response_start, len(record.token_ids)], dtype="<i8").tobytes())
        hasher.update(np.ascontiguousarray(record.token_ids, dtype="<i8").tobytes())
    return hasher.hexdigest()


def file_digest(path: pathlib.Path) -> str:
    # The project's file hash (as trainer/checkpoint_dirs.py): blake3 over a memory map, threaded.
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:
        hasher.update_mmap(path)
    return hasher.hexdigest()


def checkpoint_digest(directory: str | os.PathLike) -> str:
    """blake3 over every file of a checkpoint directory (relative name, size and blake3 of each, sorted by
    name): the same weights, config and tokenizer files give the same digest wherever they lie. A GGUF teacher (the
    file, or a directory holding it) is that one file, whatever dtype it is served in."""
    gguf = gguf_file(directory)
    directory = pathlib.Path(directory)
    if gguf is not None:
        directory, files = pathlib.Path(gguf).parent, [pathlib.Path(gguf)]
    elif not directory.is_dir():
        raise ValueError(f"teacher checkpoint {directory} is not a directory")
    else:
        files = sorted(path for path in directory.rglob("*") if path.is_file())
    hasher = blake3.blake3()
    if not files:
        raise ValueError(f"teacher checkpoint {directory} holds no files")
    for path in files:
        line = f"{path.relative_to(directory).as_posix()}\0{path.stat().st_size}\0{file_digest(path)}\n"
        hasher.update(line.encode())
    return hasher.hexdigest()


@dataclasses.dataclass(kw_only=True, slots=True)
class CacheManifest:
    """What a cache holds and what it was built from (``manifest.json``).

    Attributes:
        teacher: the teacher's identity: ``client``, ``backend`` and ``model`` (as the build's config named
            them), ``checkpoint_blake3`` (:func:`checkpoint_digest` of its checkpoint, or None when the
            build could not read it, e.g. a remote service) and ``info`` (its start-up INFO).
        tokenizer_digest: digest of the tokenizer that tokenized the dataset (the student's).
        signal: ``topk`` or ``hidden``.
        top_k: k of the top-k signal (None with the hidden signal).
        temperature: the teacher's temperature.
        hidden_dtype: the hidden states' dtype (None with the top-k signal).
        dataset: ``path``, ``blake3`` (:func:`dataset_digest`), ``num_records``, ``num_response_tokens``.
        records_per_shard: records per shard (the last one may hold fewer).
        generation: a cache of teacher-written responses: how the teacher wrote them (``num_per_prompt``,
            ``temperature``, ``top_p``, ``top_k``, ``max_tokens``, ``stop_ids``, ``seed``, ``prompts_per_request``;
            :mod:`.generated`); ``dataset`` then describes the prompts. None: the dataset's own responses, scored.
        teacher_tokenizer_digest: a cross-tokenizer teacher's own tokenizer (``teacher.cross_tokenizer``): the cache
            was built for this pair of tokenizers, its rows hold teacher ids of the records' text as the teacher
            tokenizes it (:mod:`megatron_gkd.teacher.clients.cross_request`). None: the teacher shares the student's tokenizer.
        teacher_prompt: a cross-tokenizer teacher's prompt rule (:func:`megatron_gkd.teacher.clients.cross_prompt.prompt_rule`:
            ``text``, or ``template:`` and its chat template's digest): the prompts its rows were scored after. None:
            the same tokenizer, or a cache built before the rule was recorded (a run refuses it for a pair).
        shards: per shard ``name``, ``num_records``, ``num_rows``, ``bytes`` and ``blake3``; in a build's plan
            (``build.json``), the shards written so far.
        mac: ``hmac-sha256:HEX`` of every other field (:func:`manifest_mac`) with the run's secret, or None when the
            build had no secret.
    """

    teacher: dict[str, Any]
    tokenizer_digest: str
    signal: str
    top_k: int | None
    temperature: float
    hidden_dtype: str | None
    dataset: dict[str, Any]
    records_per_shard: int
    teacher_tokenizer_digest: str | None = None
    teacher_prompt: str | None = None
    generation: dict[str, Any] | None = None
    shards: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    format: str = FORMAT
    version: int = VERSION
    mac: str | None = None

    @property
    def num_shards(self) -> int:
        records = self.dataset["num_records"]
        return (records + self.records_per_shard - 1) // self.records_per_shard

    def plan(self) -> "CacheManifest":
        """This manifest without its shard list and MAC: what a build is asked to do."""
        return dataclasses.replace(self, shards=[], mac=None)

    def signed(self, secret: bytes | None) -> "CacheManifest":
        """This manifest with the MAC of its content under ``secret`` (None: without a MAC)."""
        return dataclasses.replace(self, mac=manifest_mac(self, secret) if secret else None)

    def to_json(self) -> str:
        return json.dumps(_stored_fields(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> "CacheManifest":
        try:
            values = json.loads(text)
            if values.get("format") != FORMAT:
                raise ValueError(f"format {values.get('format')!r} is not {FORMAT!r}")
            if values.get("version") not in READABLE_VERSIONS:
                raise ValueError(f"version {values.get('version')!r}; this code reads versions "
                                 f"{', '.join(map(str, READABLE_VERSIONS))}")
            return cls(**values)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{source} is not a teacher cache manifest: {error}") from None


def _stored_fields(manifest: CacheManifest) -> dict[str, Any]:
    """The manifest's fields as written; a cache of the dataset's responses has no ``generation`` key and a
    same-tokenizer one no ``teacher_prompt``, so their files (and MACs) are what they were before the fields existed,
    and older readers still read them."""
    fields = dataclasses.asdict(manifest)
    for key in ("generation", "teacher_prompt"):
        if fields[key] is None:
            del fields[key]
    return fields


def manifest_mac(manifest: CacheManifest, secret: bytes) -> str:
    """HMAC-SHA256 under ``secret`` of the manifest's every field but ``mac``, as canonical JSON (sorted keys, no
    spaces): the teacher's identity and checkpoint digest, tokenizer, signal, k, temperature, dataset digest and
    each shard's blake3 (so the MAC covers the shards' bytes too).

    Raises:
        ValueError: ``secret`` is shorter than :data:`~megatron_gkd.teacher.protocol.security.MIN_SECRET_BYTES`.
    """
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the run's secret has {len(secret)} bytes; a teacher cache's MAC needs at least "
                         f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32 > FILE; chmod 600 FILE`)")
    fields = _stored_fields(dataclasses.replace(manifest, mac=None))
    if fields["teacher_tokenizer_digest"] is None:  # a same-tokenizer cache signs as it did before the field existed
        del fields["teacher_tokenizer_digest"]
    content = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return "hmac-sha256:" + hmac.new(secret, MAC_CONTEXT + content, hashlib.sha256).hexdigest()


def verify_mac(manifest: CacheManifest, secret: bytes | None, source: str) -> bool:
    """Whether ``manifest`` is authenticated: True when its MAC verifies with ``secret``, False without a secret
    (nothing can be checked; the caller decides what an unverified manifest may do).

    Raises:
        ValueError: a secret is given and the manifest carries no MAC, or one that does not verify.
    """
    if not secret:
        return False
    if manifest.mac is None:
        raise ValueError(f"{source} carries no MAC and this run has a secret (teacher.secret_file or {SECRET_ENV}): "
                         "it was built without the secret, or its MAC was removed; rebuild it with the run's secret")
    if not hmac.compare_digest(manifest.mac.encode(), manifest_mac(manifest, secret).encode()):
        raise ValueError(f"{source}: its MAC does not verify with this run's secret: the manifest was edited after "
                         "it was built, or it was built with another secret; rebuild it with the run's secret")
    return True


def write_atomically(path: pathlib.Path, data: bytes) -> None:
    """Writes ``data`` to a temporary name beside ``path``, fsyncs it, then renames: ``path`` is either
    absent or complete, whenever the writer dies."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)
    descriptor = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # makes the rename durable
    finally:
        os.close(descriptor)


def encode_shard(records: list[CacheRecord], outputs: list[TeacherOutput], *, signal: str, hidden_dtype: str | None,
                 number: int, generated: bool = False) -> bytes:
    """The bytes of one shard (see the module docstring for its tensors; ``generated``: the records are teacher-written
    responses, stored with their ids and their prompts' digests)."""
    assert len(records) == len(outputs) and records
    lengths = [len(output.token_logprobs) for output in outputs]
    tensors = {
        "digest": torch.from_numpy(np.frombuffer(b"".join(sequence_digest(r.token_ids, r.response_start)
                                                          for r in records), dtype=np.uint8).reshape(-1, 32).copy()),
        "record_index": torch.tensor([r.index for r in records], dtype=torch.int64),
        "offsets": torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)),
        "token_logprobs": torch.from_numpy(np.concatenate([o.token_logprobs for o in outputs])),
    }
    if Signal(signal).sends_hidden:
        hidden = torch.from_numpy(np.concatenate([o.hidden for o in outputs]))
        stored = hidden.to(HIDDEN_TORCH_DTYPES[hidden_dtype])
        # The teacher sent these values in hidden_dtype and the client widened them: narrowing is exact.
        if not torch.equal(stored.float(), hidden):
            raise ValueError(f"the teacher's hidden states are not {hidden_dtype} values widened to float32; "
                             "the cache would round them")
        tensors["hidden"] = stored
    else:
        ids = np.concatenate([o.topk_ids for o in outputs])
        if ids.size and ids.max() > np.iinfo(np.int32).max:
            raise ValueError(f"teacher id {int(ids.max())} does not fit the cache's int32 ids")
        tensors["topk_ids"] = torch.from_numpy(ids.astype(np.int32))
        tensors["topk_logprobs"] = torch.from_numpy(np.concatenate([o.topk_logprobs for o in outputs]))
    if generated:
        prompts = b"".join(sequence_digest(r.token_ids[:r.response_start], r.response_start) for r in records)
        tensors["prompt_digest"] = torch.from_numpy(np.frombuffer(prompts, dtype=np.uint8).reshape(-1, 32).copy())
        responses = np.concatenate([r.token_ids[r.response_start:] for r in records])
        if responses.max() > np.iinfo(np.int32).max:
            raise ValueError(f"response id {int(responses.max())} does not fit the cache's int32 ids")
        tensors["response_ids"] = torch.from_numpy(responses.astype(np.int32))
    from safetensors.torch import save

    metadata = json.dumps({"format": FORMAT, "version": VERSION, "shard": number, "signal": signal}, sort_keys=True)
    return save(tensors, metadata={SHARD_METADATA_KEY: metadata})


class CacheReader:
    """Reads a complete cache: its manifest, an index from :func:`sequence_digest` to (shard, record) built
    at open time from the shards' ``digest`` tensors, and each record's rows (memory-mapped slices, so a
    lookup reads only its own rows). A shard's blake3 is checked against the manifest the first time it is
    read; with the run's secret, the manifest's MAC is checked when the cache is opened (:attr:`verified`).
    Thread-safe (the client scores on a thread pool).

    Args:
        directory: the cache directory.
        max_open_shards: shards kept open at once (each holds a file descriptor and a memory map).
        secret: the run's secret (:func:`~megatron_gkd.teacher.protocol.security.load_secret`), or None.

    Attributes:
        manifest: the cache's :class:`CacheManifest`.
        verified: whether the manifest's MAC verified with ``secret`` (its content is then what a holder of the
            secret built: teacher, k, temperature, dataset and every shard's hash).

    Raises:
        ValueError: no manifest (an unfinished or missing build: the message says which command fixes it), a
            manifest of another format, a shard missing or of the wrong size, or (with a secret) a manifest
            without a MAC or with one that does not verify.
    """

    def __init__(self, directory: str | os.PathLike, max_open_shards: int = 64, secret: bytes | None = None):
        import collections
        import threading

        self.directory = pathlib.Path(directory)
        path = self.directory / MANIFEST
        if not path.is_file():
            if (self.directory / PLAN).is_file():
                raise ValueError(f"teacher cache {self.directory} is unfinished ({PLAN} without {MANIFEST}): rerun "
                                 "its build command (python -m megatron_gkd.teacher.cache build ... --out DIR) to "
                                 "resume it")
            raise ValueError(f"teacher cache {self.directory} holds no {MANIFEST}; build one with python -m "
                             "megatron_gkd.teacher.cache build --config CONFIG.yaml --out DIR")
        self.manifest = CacheManifest.from_json(path.read_text(), str(path))
        self.verified = verify_mac(self.manifest, secret, str(path))
        if not secret and self.manifest.mac is not None:
            logger.warning("%s carries a MAC but this run has no secret to check it (teacher.secret_file or %s): "
                           "the cache is unverified", path, SECRET_ENV)
        if len(self.manifest.shards) != self.manifest.num_shards:
            raise ValueError(f"{path} lists {len(self.manifest.shards)} shards, expected {self.manifest.num_shards}")
        self._index: dict[bytes, tuple[int, int]] = {}
        self._prompts: dict[bytes, list[tuple[int, int]]] = {}  # generation caches: a prompt's responses, in order
        self._offsets: list[np.ndarray] = []
        for number, shard in enumerate(self.manifest.shards):
            shard_path = self.directory / shard["name"]
            if not shard_path.is_file() or shard_path.stat().st_size != shard["bytes"]:
                found = shard_path.stat().st_size if shard_path.is_file() else "no"
                raise ValueError(f"teacher cache shard {shard_path}: {found} bytes, its manifest says "
                                 f"{shard['bytes']}; the cache is damaged: rebuild it")
            from safetensors import safe_open

            with safe_open(str(shard_path), framework="pt") as handle:
                digests = handle.get_tensor("digest").numpy()
                self._offsets.append(handle.get_tensor("offsets").numpy())
                prompts = handle.get_tensor("prompt_digest").numpy() if self.manifest.generation else ()
            for position, digest in enumerate(digests):
                self._index[digest.tobytes()] = (number, position)
            self._add_prompts(prompts, number)
        num_records = sum(shard["num_records"] for shard in self.manifest.shards)
        if len(self._index) < num_records:
            logger.info("teacher cache %s: %d records share %d distinct requests", self.directory, num_records,
                        len(self._index))
        self._handles: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._max_open = max_open_shards
        self._verified: set[int] = set()
        self._lock = threading.Lock()

    def _add_prompts(self, digests, number: int) -> None:
        """Indexes a generation cache's records by prompt: ``num_per_prompt`` consecutive records answer one prompt
        (a prompt that two records of the dataset share keeps the first one's responses)."""
        per_prompt = self.manifest.generation["num_per_prompt"] if self.manifest.generation else 1
        for first in range(0, len(digests), per_prompt):
            key = digests[first].tobytes()
            if key in self._prompts:
                continue
            self._prompts[key] = [(number, position) for position in range(first, first + per_prompt)]

    def __len__(self) -> int:
        return len(self._index)

    def find(self, token_ids: np.ndarray, response_start: int) -> tuple[int, int] | None:
        """``(shard, record)`` of the request, or None when the cache does not hold it."""
        return self._index.get(sequence_digest(token_ids, response_start))

    def responses(self, prompt_ids: np.ndarray) -> list[np.ndarray] | None:
        """A generation cache's responses to ``prompt_ids`` (``num_per_prompt`` int64 arrays, in the order the teacher
        wrote them), or None when the cache holds no such prompt."""
        locations = self._prompts.get(sequence_digest(prompt_ids, len(prompt_ids)))
        if locations is None:
            return None
        found = []
        with self._lock:
            for number, position in locations:
                start, end = (int(x) for x in self._offsets[number][position:position + 2])
                found.append(self._handle(number).get_slice("response_ids")[start:end].numpy().astype(np.int64))
        return found

    def output(self, location: tuple[int, int]) -> TeacherOutput:
        """The teacher's output stored at ``location`` (from :meth:`find`), as the teacher's client returned it."""
        number, position = location
        start, end = (int(x) for x in self._offsets[number][position:position + 2])
        with self._lock:
            handle = self._handle(number)
            token_logprobs = handle.get_slice("token_logprobs")[start:end].numpy()
            if Signal(self.manifest.signal).sends_hidden:
                hidden = handle.get_slice("hidden")[start:end].float().numpy()
                return TeacherOutput(topk_ids=np.zeros((end - start, 0), np.int64),
                                     topk_logprobs=np.zeros((end - start, 0), np.float32),
                                     token_logprobs=token_logprobs, hidden=hidden)
            ids = handle.get_slice("topk_ids")[start:end].numpy().astype(np.int64)
            logprobs = handle.get_slice("topk_logprobs")[start:end].numpy()
        return TeacherOutput(topk_ids=ids, topk_logprobs=logprobs, token_logprobs=token_logprobs)

    def _handle(self, number: int):
        if number in self._handles:
            self._handles.move_to_end(number)
            return self._handles[number]
        shard = self.manifest.shards[number]
        path = self.directory / shard["name"]
        if number not in self._verified:
            digest = file_digest(path)
            if digest != shard["blake3"]:
                raise ValueError(f"teacher cache shard {path} has blake3 {digest[:16]}, its manifest says "
                                 f"{shard['blake3'][:16]}: the cache is damaged; rebuild it")
            self._verified.add(number)
        from safetensors import safe_open

        handle = safe_open(str(path), framework="pt")
        self._handles[number] = handle
        if len(self._handles) > self._max_open:
            self._handles.popitem(last=False)
        return handle

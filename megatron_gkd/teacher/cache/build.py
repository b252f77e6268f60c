"""The scoring pass: every record of a dataset asked of a teacher once, written shard by shard.

Resumable: each shard is written to a temporary name and renamed, so a shard file is either complete or
absent; its blake3 is then recorded in the build's plan (``build.json``, MAC-signed with the run's secret). A
restart of the same build (the plan must be equal: same teacher, k, temperature, signal, tokenizer and
dataset) keeps the shards whose bytes still have their recorded hash, refuses one that changed since it was
written (altered, or copied from another build), scores again one it had not recorded (killed between the
rename and the record), and scores the rest. The records of a shard are sent in the same batches whether or
not the build was interrupted, and nothing in the files depends on time, so a resumed build writes the same
bytes as an uninterrupted one (given a deterministic teacher).

A plan with ``generation`` (:mod:`.generated`) has the teacher write the responses first: each shard's prompts are
sent in the same seeded generate requests whether or not the build was interrupted, so the same holds.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Callable, Sequence

import tqdm

from megatron_gkd.data.tokenization import tokenizer_digest
from megatron_gkd.teacher.cache.generated import num_requests, write_responses
from megatron_gkd.teacher.cache.store import (
    MANIFEST,
    PLAN,
    CacheManifest,
    CacheRecord,
    checkpoint_digest,
    dataset_digest,
    encode_shard,
    file_digest,
    shard_name,
    verify_mac,
    write_atomically,
)
from megatron_gkd.teacher.protocol.security import SECRET_ENV
from megatron_gkd.teacher.protocol.types import ScoreBatch, SequenceRequest, Signal, TeacherOutput

logger = logging.getLogger(__name__)


def flatten(values: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (how mismatches are named)."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def plan_differences(found: CacheManifest, wanted: CacheManifest) -> list[str]:
    """``"field: X there, Y now"`` for every field in which two plans differ."""
    old, new = flatten(dataclasses.asdict(found.plan())), flatten(dataclasses.asdict(wanted.plan()))
    return [f"{key}: {old.get(key)!r} there, {new.get(key)!r} now" for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key)]


def score_records(client, records: Sequence[CacheRecord], plan: CacheManifest, batch_size: int) -> list[TeacherOutput]:
    """The teacher's outputs for ``records``, in order, asked in batches of ``batch_size`` (in flight at once as far
    as the client allows)."""
    futures = []
    for start in range(0, len(records), batch_size):
        sequences = [SequenceRequest(token_ids=r.token_ids, response_start=r.response_start)
                     for r in records[start:start + batch_size]]
        batch = ScoreBatch(sequences=sequences, top_k=plan.top_k or 1, temperature=plan.temperature,
                           signal=plan.signal, hidden_dtype=plan.hidden_dtype or "bfloat16")
        futures.append(client.score_async(batch))
    outputs = []
    for future in futures:
        outputs += future.result()
    return outputs


def make_plan(info, identity: dict, *, teacher_checkpoint: str | None, tokenizer, records: Sequence[CacheRecord],
              data_path: str, top_k: int, temperature: float, signal: str, hidden_dtype: str,
              records_per_shard: int, cross=None, generation: dict | None = None) -> CacheManifest:
    """The manifest (without shards) of scoring ``records`` with the teacher whose INFO is ``info``.

    Args:
        info: the teacher client's :class:`~megatron_gkd.teacher.clients.TeacherInfo`.
        identity: how the config names the teacher (``client``, ``backend``, ``model``).
        teacher_checkpoint: the teacher's checkpoint directory, hashed into the manifest; None when it is not
            readable here (runs then cannot compare the cache's teacher with theirs: a warning says so).
        tokenizer: the tokenizer that tokenized ``records`` (the student's); the teacher's must be the same unless
            ``cross`` is given.
        cross: a cross-tokenizer teacher's :class:`~megatron_gkd.teacher.clients.cross_request.CrossTokenizer`: the records are scored
            as the teacher tokenizes their text, and the manifest records the pair and the teacher's prompt rule.
        generation: the teacher writes the responses (:func:`~.generated.generation_settings`); ``records`` are then
            the prompts alone (:func:`~.generated.prompt_records`).

    Raises:
        ValueError: the tokenizers differ (unasked, or not the pair ``cross`` names), the teacher cannot serve the
            signal or k, or it is asked to write responses it cannot (or in another tokenizer's ids).
    """
    digest = tokenizer_digest(tokenizer)
    if cross is not None:
        if info.tokenizer_digest != cross.teacher_digest:
            raise ValueError(f"teacher.cross_tokenizer.tokenizer (digest {cross.teacher_digest[:12]}) is not the "
                             f"teacher's own tokenizer (digest {str(info.tokenizer_digest)[:12]})")
    elif (info.tokenizer_digest, info.tokenizer_size) != (digest, len(tokenizer)):
        raise ValueError(f"tokenizer mismatch: the teacher's tokenizer ({info.tokenizer_size} tokens, digest "
                         f"{str(info.tokenizer_digest)[:12]}) differs from student.tokenizer ({len(tokenizer)} tokens, "
                         f"digest {digest[:12]}); to distil across tokenizers set teacher.cross_tokenizer.method="
                         "projected (or hybrid), otherwise use a teacher with the student's tokenizer")
    hidden = Signal(signal).sends_hidden
    if signal not in info.signals:
        raise ValueError(f"teacher.signal={signal}: this teacher serves {', '.join(info.signals)} only")
    if not hidden and top_k > info.max_top_k:
        raise ValueError(f"teacher.top_k={top_k} exceeds what the teacher serves (max {info.max_top_k})")
    if generation is not None and cross is not None:
        raise ValueError("teacher.cross_tokenizer: a teacher of another tokenizer writes its responses in its own ids, "
                         "which the student cannot train on (sample_mix.source=teacher is refused for it too)")
    if generation is not None and not info.supports_generate:
        raise ValueError("this teacher cannot write responses (a backend without sampling, or a server older than "
                         "generate requests): serve it with the hf, vllm or megatron backend")
    if records_per_shard < 1:
        raise ValueError(f"records_per_shard={records_per_shard} must be >= 1")
    if teacher_checkpoint is None:
        logger.warning("no teacher checkpoint to hash (the teacher runs elsewhere): runs cannot compare the cache's "
                       "teacher with theirs, and without the run's secret (a signed manifest) they refuse it unless "
                       "teacher.cache_trust_unverified=true; pass --teacher-checkpoint DIR")
    identity = dict(identity, info=dataclasses.asdict(info),
                    checkpoint_blake3=checkpoint_digest(teacher_checkpoint) if teacher_checkpoint else None)
    return CacheManifest(
        teacher=identity, tokenizer_digest=digest, signal=signal, top_k=None if hidden else top_k,
        temperature=float(temperature), hidden_dtype=hidden_dtype if hidden else None,
        dataset={"path": data_path, "blake3": dataset_digest(records), "num_records": len(records),
                 "num_response_tokens": sum(len(r.token_ids) - r.response_start for r in records)},
        records_per_shard=records_per_shard, teacher_tokenizer_digest=None if cross is None else cross.teacher_digest,
        teacher_prompt=None if cross is None else cross.prompts.description, generation=generation)


def build_cache(client, records: Sequence[CacheRecord], out: str | pathlib.Path, plan: CacheManifest, *,
                batch_size: int = 16, show_progress: bool = False, on_shard: Callable[[int], None] | None = None,
                secret: bytes | None = None) -> CacheManifest:
    """Scores ``records`` through ``client`` into ``out`` (resuming a build of the same plan there).

    Args:
        client: a teacher client (``score_async``); its outputs are stored as it returns them.
        records: the dataset's records, in order (:func:`~megatron_gkd.teacher.cache.store.dataset_records`); with
            ``plan.generation``, its prompts (:func:`~.generated.prompt_records`), each answered
            ``num_per_prompt`` times by the teacher.
        out: the cache directory.
        plan: the manifest to write, without shards (teacher, tokenizer, k, temperature, signal, dataset).
        batch_size: sequences per teacher request (a generation plan sends its own ``prompts_per_request``).
        show_progress: draw a progress bar over the records.
        on_shard: called with each shard's number once it is on disk and recorded (written or found).
        secret: the run's secret: the plan and the manifest are signed with it (:func:`~.store.manifest_mac`), and
            a resumed plan must verify with it.

    Returns:
        The complete manifest (also written to ``out/manifest.json``).

    Raises:
        ValueError: ``out`` holds a build (finished or not) of another plan; the message names each field
            that differs; or a shard there changed since this build wrote it; or its plan's MAC does not
            verify with ``secret`` (or it has one and no secret is given).
    """
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    assert len(records) == plan.dataset["num_records"]
    done = out / MANIFEST
    if done.is_file():
        manifest = CacheManifest.from_json(done.read_text(), str(done))
        verify_mac(manifest, secret, str(done))
        differences = plan_differences(manifest, plan)
        if differences:
            raise ValueError(f"{out} holds a complete teacher cache of another build ({'; '.join(differences)}); "
                             "choose another --out or delete it")
        logger.info("teacher cache %s is already complete (%d shards)", out, len(manifest.shards))
        return manifest
    recorded = {entry["name"]: entry for entry in _adopt_plan(out, plan, secret).shards}
    for stale in out.glob(".shard-*.tmp-*"):
        stale.unlink()  # a write that died before its rename
    per_shard = plan.records_per_shard
    bar = tqdm.tqdm(total=len(records), desc=f"scoring into {out}", unit="records",
                    disable=None if show_progress else True)
    with bar:
        for number in range(plan.num_shards):
            chunk = records[number * per_shard:(number + 1) * per_shard]
            path = out / shard_name(number)
            if not (path.is_file() and _kept(path, recorded.get(path.name))):
                stored, outputs = _shard_answers(client, chunk, plan, batch_size, number)
                write_atomically(path, encode_shard(stored, outputs, signal=plan.signal, hidden_dtype=plan.hidden_dtype,
                                                    number=number, generated=plan.generation is not None))
                # Hashed once, as written; the plan then records it (rewritten whole: a few hundred bytes a shard).
                recorded[path.name] = _shard_entry(path)
                shards = [recorded[shard_name(n)] for n in range(plan.num_shards) if shard_name(n) in recorded]
                write_atomically(out / PLAN, dataclasses.replace(plan, shards=shards).signed(secret).to_json().encode())
            bar.update(len(chunk))
            if on_shard is not None:
                on_shard(number)
    manifest = dataclasses.replace(plan, shards=[recorded[shard_name(n)] for n in range(plan.num_shards)])
    manifest = manifest.signed(secret)
    write_atomically(done, manifest.to_json().encode())
    (out / PLAN).unlink()
    total = sum(shard["bytes"] for shard in manifest.shards)
    tokens = sum(shard["num_rows"] for shard in manifest.shards)
    logger.info("teacher cache %s: %d records, %d response tokens, %d shards, %.1f MiB (%.1f bytes per response token)",
                out, sum(shard["num_records"] for shard in manifest.shards), tokens, plan.num_shards, total / 2**20,
                total / max(tokens, 1))
    return manifest


def _shard_answers(client, chunk: Sequence[CacheRecord], plan: CacheManifest, batch_size: int,
                   number: int) -> tuple[Sequence[CacheRecord], list[TeacherOutput]]:
    """The records shard ``number`` stores and the teacher's outputs for them: ``chunk`` scored, or (a generation
    plan) the teacher's responses to ``chunk``'s prompts, scored."""
    if plan.generation is None:
        return chunk, score_records(client, chunk, plan, batch_size)
    # Every shard but the last holds records_per_shard prompts: the requests before this shard's are counted so.
    first = number * num_requests(plan.records_per_shard, plan.generation["prompts_per_request"])
    return write_responses(client, chunk, plan, first_request=first)


def _adopt_plan(out: pathlib.Path, plan: CacheManifest, secret: bytes | None) -> CacheManifest:
    """Writes the plan of a new build, or checks that an unfinished build there has the same one (and, with the
    run's secret, that its plan verifies); returns the plan there, with the shards it recorded."""
    path = out / PLAN
    if not path.is_file():
        if any(out.glob("shard-*.safetensors")):
            raise ValueError(f"{out} holds shards but no {PLAN}: not a build this command can resume; choose another "
                             "--out or delete it")
        write_atomically(path, plan.signed(secret).to_json().encode())
        return plan
    found = CacheManifest.from_json(path.read_text(), str(path))
    if not verify_mac(found, secret, str(path)) and found.mac is not None:
        raise ValueError(f"{out} holds a build started with the run's secret; resume it with the same secret "
                         f"(teacher.secret_file or {SECRET_ENV})")
    differences = plan_differences(found, plan)
    if differences:
        raise ValueError(f"{out} holds an unfinished teacher cache of another build ({'; '.join(differences)}); "
                         "rerun it with its own config, or choose another --out")
    logger.info("resuming the teacher cache build in %s (%d of %d shards recorded)", out, len(found.shards),
                plan.num_shards)
    return found


def _kept(path: pathlib.Path, entry: dict | None) -> bool:
    """Whether a shard found on disk is the one this build wrote (hashed again: once per resume).

    Raises:
        ValueError: its bytes are not those whose hash the build recorded.
    """
    if entry is None:
        logger.info("%s is not recorded in the build's plan (the build stopped before recording it): scoring it "
                    "again", path)
        return False
    digest = file_digest(path)
    if digest != entry["blake3"]:
        raise ValueError(f"{path} has changed since this build wrote it (blake3 {digest[:16]}, recorded "
                         f"{entry['blake3'][:16]}): it was altered or copied from another build; delete it and "
                         "rerun the command to score it again")
    return True


def _shard_entry(path: pathlib.Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        num_records = handle.get_slice("record_index").get_shape()[0]
        num_rows = handle.get_slice("token_logprobs").get_shape()[0]
    return {"name": path.name, "num_records": int(num_records), "num_rows": int(num_rows),
            "bytes": path.stat().st_size, "blake3": file_digest(path)}

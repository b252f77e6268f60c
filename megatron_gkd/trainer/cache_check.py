"""A teacher cache checked against the run that reads it (start-up): the run's layer, since it reads the run's config
(data, sampling, eval, the mixture) to compare it with the cache's manifest (docs/teacher_cache.md, SECURITY.md)."""

from __future__ import annotations

import logging
import time

from megatron_gkd.config import eval_enabled, needs_responses
from megatron_gkd.config.checks import teacher_response_limit
from megatron_gkd.data import load_prompts, load_tokenizer
from megatron_gkd.data.tokenization import stop_token_ids, tokenizer_digest
from megatron_gkd.teacher.cache.generated import REBUILD_FLAG, SAMPLING_KEYS, prompt_records, sampling_settings
from megatron_gkd.teacher.cache.store import checkpoint_digest, dataset_digest, dataset_records
from megatron_gkd.teacher.clients.cross_prompt import prompt_rule
from megatron_gkd.teacher.protocol.security import SECRET_ENV

logger = logging.getLogger(__name__)

_BUILD = "python -m megatron_gkd.teacher.cache build --config CONFIG --out DIR"


def check_cache_run(client, config, tokenizer, teacher=None) -> None:
    """Refuses a teacher cache (``client``, a :class:`CacheTeacherClient`) that does not belong to the run ``config``
    describes (the trainer calls it at start-up;
    ``teacher``: the run's section of this teacher, default ``config.teacher``).

    Compares the run's teacher checkpoint (``teacher.checkpoint`` / ``teacher.head_checkpoint``, when set),
    tokenizer, ``teacher.top_k``, ``teacher.temperature``, ``teacher.signal`` (and ``teacher.hidden_dtype``)
    and the dataset (``data.train_path`` loaded and tokenized as the trainer does) with the manifest. The
    manifest is trusted to name the cache's teacher only when its MAC verified with the run's secret; without
    one, the run must name its teacher (``teacher.checkpoint``) or opt out (``teacher.cache_trust_unverified``).

    A cache of teacher-written responses serves sequence-level KD only (``sample_mix.source=teacher``, ``lmbda``
    0 at every step); its dataset is the prompts, and the run's ``sample_mix.teacher.*`` settings and stop ids
    must be those the responses were written with, ``rollout.n`` at most the responses stored per prompt.

    Raises:
        ValueError: the run cannot be served from a cache (on-policy, eval KL, the student's samples mixed in, a
            cache of the other kind), it cannot bind the cache to a teacher, or it differs from the cache; the
            message names every field that differs with the cache's and the run's value.
    """
    _check_kind(client, config)
    if eval_enabled(config) and config.eval.kl:
        raise ValueError("eval.kl scores the student's own eval answers, which no teacher cache holds: set "
                         "eval.kl=false, or use a live teacher")
    manifest, teacher = client.manifest, teacher if teacher is not None else config.teacher
    _check_bound(client, teacher)
    teacher_tokenizer = load_tokenizer(teacher.tokenizer_source) if teacher.cross_tokenizer.enabled else None
    pairs = {"tokenizer_digest": (manifest.tokenizer_digest, tokenizer_digest(tokenizer)),
             # the teacher's own tokenizer and what it read before each response, for a cache built for a pair
             "teacher.cross_tokenizer.tokenizer": (
                 manifest.teacher_tokenizer_digest,
                 None if teacher_tokenizer is None else tokenizer_digest(teacher_tokenizer)),
             "teacher.cross_tokenizer.prompt": (
                 manifest.teacher_prompt,
                 None if teacher_tokenizer is None else prompt_rule(teacher.cross_tokenizer, teacher_tokenizer)),
             "teacher.signal": (manifest.signal, teacher.signal),
             "teacher.temperature": (manifest.temperature, float(teacher.temperature))}
    if teacher.signal == manifest.signal:  # the settings of the signal both have
        if teacher.signal.sends_hidden:
            pairs["teacher.hidden_dtype"] = (manifest.hidden_dtype, teacher.hidden_dtype)
        else:
            pairs["teacher.top_k"] = (manifest.top_k, teacher.top_k)
    cached_checkpoint = manifest.teacher.get("checkpoint_blake3")
    for key in ("checkpoint", "head_checkpoint"):
        directory = getattr(teacher, key)
        if directory is not None:
            started = time.monotonic()
            pairs[f"teacher.{key}"] = (cached_checkpoint, checkpoint_digest(directory))
            logger.info("teacher.%s=%s hashed in %.1f s", key, directory, time.monotonic() - started)
    dataset = load_prompts(config.data.train_path, config.data, tokenizer, require_responses=needs_responses(config))
    records = dataset_records(dataset) if client.generation is None else prompt_records(dataset)
    pairs["data.train_path"] = (manifest.dataset["blake3"], dataset_digest(records))
    if client.generation is not None:
        run = sampling_settings(config.sample_mix.teacher, teacher_response_limit(config),
                                stop_token_ids(config.rollout.stop_token_ids, tokenizer))
        pairs.update({name: (client.generation[key], run[key]) for key, name in SAMPLING_KEYS.items()})
    mismatches = [f"{field}: {cached!r} in the cache, {wanted!r} in this run"
                  for field, (cached, wanted) in pairs.items() if cached != wanted]
    if mismatches:
        raise ValueError(f"teacher cache {client.reader.directory} does not match this run (teacher "
                         f"{manifest.teacher.get('model')}, dataset {manifest.dataset.get('path')}): "
                         + "; ".join(mismatches) + ". Build a cache for this run (python -m "
                         "megatron_gkd.teacher.cache build --config CONFIG --out DIR) or point teacher.cache_dir "
                         "at one")
    logger.info("teacher cache %s matches this run (%d records of %s)", client.reader.directory,
                manifest.dataset["num_records"], config.data.train_path)

def _check_kind(client, config) -> None:
    """Refuses a run whose responses this kind of cache does not hold.

    Raises:
        ValueError: a run that samples without taking every response from the teacher, a run that takes them from
            the teacher with a cache of the dataset's responses (or the reverse), or one that asks for more
            responses per prompt than the cache holds.
    """
    mix, directory = config.sample_mix, client.reader.directory
    written = mix.enabled and mix.source_traits.teacher_writes
    if config.trainer.run_mode.samples and not written:
        raise ValueError("teacher.client=cache cannot score on-policy samples (they are new every step): use "
                         "trainer.mode=off_policy, or a live teacher (or, for sequence-level KD, a cache of "
                         "teacher-written responses with sample_mix.source=teacher sample_mix.lmbda=0)")
    if written and not mix.never_student(config.trainer.num_steps):
        raise ValueError(f"sample_mix.lmbda={mix.lmbda} (schedule {mix.schedule}) draws the student's own samples "
                         "at some step, which no teacher cache can score: a cache of teacher-written responses "
                         "serves sample_mix.lmbda=0 at every step only; use a live teacher for the mixture")
    if written and client.generation is None:
        raise ValueError(f"teacher cache {directory} holds the dataset's own responses scored, and "
                         "sample_mix.source=teacher trains on responses the teacher writes: build a cache of "
                         f"teacher-written responses from this run's config ({_BUILD}), or use a live teacher")
    if not written and client.generation is not None:
        raise ValueError(f"teacher cache {directory} holds responses the teacher wrote, which only a run with "
                         "sample_mix.source=teacher (and sample_mix.lmbda=0) trains on; build a cache of the "
                         f"dataset's responses for this run ({_BUILD}), or set sample_mix.source=teacher "
                         "sample_mix.lmbda=0")
    if written and config.rollout.n > client.generation["num_per_prompt"]:
        raise ValueError(f"rollout.n={config.rollout.n}: teacher cache {directory} holds "
                         f"{client.generation['num_per_prompt']} responses per prompt; rebuild it with "
                         f"{REBUILD_FLAG} {config.rollout.n} (or more), or lower rollout.n")

def _check_bound(client, teacher) -> None:
    """Refuses a cache this run cannot bind to a teacher, unless ``teacher.cache_trust_unverified`` is set."""
    identity = client.manifest.teacher
    named = f"{identity.get('model')} (checkpoint blake3 {identity.get('checkpoint_blake3')})"
    named_by_run = teacher.checkpoint is not None or teacher.head_checkpoint is not None
    if (named_by_run or client.reader.verified) and teacher.cache_trust_unverified:
        logger.warning("teacher.cache_trust_unverified has no effect: this run binds cache %s to a teacher (by %s)",
                       client.reader.directory, "teacher.checkpoint" if named_by_run else "its manifest's MAC")
    if named_by_run:
        return  # the manifest's checkpoint digest is compared with the run's
    if client.reader.verified:
        logger.info("teacher cache %s: its manifest's MAC verifies with the run's secret; its teacher is %s (set "
                    "teacher.checkpoint=DIR to also check it is this run's)", client.reader.directory, named)
        return
    if teacher.cache_trust_unverified:
        logger.warning("teacher cache %s is used UNVERIFIED (teacher.cache_trust_unverified=true): nothing checks "
                       "that its teacher, %s, is this run's or that its manifest is unedited",
                       client.reader.directory, named)
        return
    raise ValueError(f"teacher cache {client.reader.directory} cannot be bound to a teacher: this run has no secret "
                     f"to check its manifest's MAC and no teacher.checkpoint to compare its teacher with (it names "
                     f"{named}). Set teacher.checkpoint=DIR (the teacher's checkpoint directory), or give the "
                     f"run's secret (teacher.secret_file or {SECRET_ENV}) if the cache was built with it, or set "
                     "teacher.cache_trust_unverified=true to use it unchecked")

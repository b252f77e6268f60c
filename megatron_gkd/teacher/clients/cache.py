"""``cache`` client: the teacher's answers read from a teacher cache (``teacher.cache_dir``), no teacher running.

A request is looked up by the blake3 of its token ids and response start (an index built when the cache is
opened), so any order, batching or data-parallel split of the dataset finds its rows; the outputs are the
arrays the live teacher's client returned when the cache was built, validated again. A sequence the cache
does not hold (an on-policy sample, an eval answer, a record of another dataset) fails naming the fix.

At start-up the trainer calls :meth:`CacheTeacherClient.check_run`, which refuses a cache of another teacher,
tokenizer, k, temperature, signal or dataset, and one it cannot bind to a teacher: a manifest whose MAC does not
verify with the run's secret, or, without a secret, a run without ``teacher.checkpoint`` (docs/teacher_cache.md,
SECURITY.md).

A cache of teacher-written responses (:mod:`megatron_gkd.teacher.cache.generated`) also answers generate requests:
the stored responses of each prompt, looked up by its ids; their scores are then found by the same lookup as any
sequence's. It serves sequence-level KD only (``sample_mix.source=teacher``, ``sample_mix.lmbda`` 0 at every step).
"""

from __future__ import annotations

import logging
import threading
import time

from megatron_gkd.config import eval_enabled, needs_responses
from megatron_gkd.data import load_prompts, load_tokenizer
from megatron_gkd.data.tokenization import stop_token_ids, tokenizer_digest
from megatron_gkd.teacher.cache.generated import (
    REBUILD_FLAG,
    SAMPLING_KEYS,
    pick_responses,
    prompt_records,
    sampling_settings,
    setting_differences,
)
from megatron_gkd.teacher.cache.store import CacheReader, checkpoint_digest, dataset_digest, dataset_records
from megatron_gkd.teacher.clients import TeacherClient, TeacherInfo
from megatron_gkd.teacher.security import SECRET_ENV, load_secret
from megatron_gkd.teacher.types import (
    ErrorCode,
    GenerateBatch,
    GeneratedSample,
    ScoreBatch,
    Signal,
    TeacherError,
    TeacherOutput,
    check_generated,
)

logger = logging.getLogger(__name__)

_FIX = ("a teacher cache answers the dataset's own responses only (trainer.mode=off_policy); score other sequences "
        "with a live teacher (teacher.client=zmq, openai or local)")
_GENERATED_FIX = ("a cache of teacher-written responses answers its own responses to the dataset's prompts only "
                  "(sample_mix.source=teacher, sample_mix.lmbda=0); score other sequences with a live teacher "
                  "(teacher.client=zmq, openai or local)")
_BUILD = "python -m megatron_gkd.teacher.cache build --config CONFIG --out DIR"


class CacheTeacherClient(TeacherClient):
    """Answers :class:`ScoreBatch` requests from a teacher cache (and :class:`GenerateBatch` requests from a cache of
    teacher-written responses).

    Args:
        cache_dir: the cache directory (``python -m megatron_gkd.teacher.cache build ... --out DIR``).
        max_inflight: batches read concurrently by ``score_async``.
        secret: the run's secret: the manifest's MAC must verify with it.

    Raises:
        ValueError: the directory holds no complete cache (the message says how to build or resume one), or a
            secret is given and the manifest's MAC is missing or does not verify.
    """

    @classmethod
    def from_config(cls, config, secret: bytes | None = None):
        """Built from the ``teacher`` section (:class:`~megatron_gkd.teacher.config.TeacherConfig`); the secret
        from ``teacher.secret_file`` or $MEGATRON_GKD_TEACHER_SECRET unless given."""
        return cls(cache_dir=config.cache_dir, max_inflight=config.max_inflight,
                   secret=secret if secret is not None else load_secret(config.secret_file))

    def __init__(self, cache_dir: str, max_inflight: int = 2, secret: bytes | None = None):
        super().__init__(max_inflight=max_inflight)
        self.reader = CacheReader(cache_dir, secret=secret)
        self.manifest = self.reader.manifest
        self.generation = self.manifest.generation  # how the teacher wrote the responses, or None
        self._fix = _FIX if self.generation is None else _GENERATED_FIX
        self._num_scored = 0
        self._count_lock = threading.Lock()
        teacher = self.manifest.teacher
        logger.info("teacher cache %s: %d records, signal %s, k %s, temperature %s, teacher %s (%s backend, blake3 %s)",
                    cache_dir, len(self.reader), self.manifest.signal, self.manifest.top_k, self.manifest.temperature,
                    teacher.get("model"), teacher.get("backend"), str(teacher.get("checkpoint_blake3"))[:16])

    @property
    def num_scored(self) -> int:
        """Sequences answered from the cache over this client's life."""
        return self._num_scored

    def info(self) -> TeacherInfo:
        stored = dict(self.manifest.teacher["info"])
        hidden = Signal(self.manifest.signal).sends_hidden
        # The cache serves what it holds: its signal only, its k, no requested ids (they depend on the student).
        # It writes no responses: it answers generate requests only with those its build stored.
        stored.update(signals=[self.manifest.signal], hidden_size=stored.get("hidden_size") if hidden else None,
                      supports_requested_ids=False, supports_temperature=True,
                      supports_generate=self.generation is not None)
        if not hidden:
            stored["max_top_k"] = self.manifest.top_k
        return TeacherInfo(**stored)

    def _score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        manifest = self.manifest
        asked = {"signal": batch.signal, "temperature": batch.temperature}
        held = {"signal": manifest.signal, "temperature": manifest.temperature}
        if not batch.is_hidden:
            asked["top_k"], held["top_k"] = batch.top_k, manifest.top_k
        else:
            asked["hidden_dtype"], held["hidden_dtype"] = batch.hidden_dtype, manifest.hidden_dtype
        if asked != held:
            raise TeacherError(ErrorCode.BAD_REQUEST, f"the request asks for {asked}, the teacher cache holds {held}")
        if batch.num_requested is not None:
            raise TeacherError(ErrorCode.UNSUPPORTED, "requested ids (TCAD) depend on the student's top-k at each "
                                                      "step, which no teacher cache holds; " + self._fix)
        hidden_size = manifest.teacher["info"].get("hidden_size") if batch.is_hidden else None
        outputs = []
        for number, sequence in enumerate(batch.sequences):
            location = self.reader.find(sequence.token_ids, sequence.response_start)
            if location is None:
                raise TeacherError(ErrorCode.BAD_REQUEST,
                                   f"sequence {number} of the batch ({len(sequence.token_ids)} tokens, response from "
                                   f"{sequence.response_start}) is not in the teacher cache {self.reader.directory}; "
                                   + self._fix)
            output = self.reader.output(location)
            outputs.append(output.validate(sequence.num_response_tokens, batch.top_k, name=f"cached sequence {number}",
                                           sequence=sequence, hidden_size=hidden_size))
        with self._count_lock:
            self._num_scored += len(outputs)
        return outputs

    def _generate(self, batch: GenerateBatch) -> list[GeneratedSample]:
        """Each prompt's stored responses, ``num_samples`` of them (:func:`~megatron_gkd.teacher.cache.generated.
        pick_responses`), with their stored rows when ``score_top_k`` asks for them."""
        generation = self.generation
        if generation is None:
            raise TeacherError(ErrorCode.UNSUPPORTED, f"teacher cache {self.reader.directory} holds the dataset's own "
                               "responses scored, not responses the teacher wrote; build one of teacher-written "
                               f"responses from a config with sample_mix.source=teacher ({_BUILD})")
        asked = {"temperature": batch.temperature, "top_p": batch.top_p, "top_k": batch.top_k,
                 "max_tokens": batch.max_tokens, "stop_ids": list(batch.stop_ids)}
        differences = setting_differences(generation, asked)
        if differences:
            raise TeacherError(ErrorCode.BAD_REQUEST, f"the teacher cache {self.reader.directory} holds responses "
                               f"written with other settings: {'; '.join(differences)}")
        stored = generation["num_per_prompt"]
        if batch.num_samples > stored:
            raise TeacherError(ErrorCode.BAD_REQUEST, f"the request asks for {batch.num_samples} responses per prompt, "
                               f"the teacher cache {self.reader.directory} holds {stored}; rebuild it with "
                               f"{REBUILD_FLAG} {batch.num_samples} (or more)")
        samples = []
        for index, prompt in enumerate(batch.prompts):
            responses = self.reader.responses(prompt)
            if responses is None:
                raise TeacherError(ErrorCode.BAD_REQUEST, f"prompt {index} of the request ({len(prompt)} tokens) is not "
                                   f"in the teacher cache {self.reader.directory}; " + self._fix)
            samples += [GeneratedSample(prompt_index=index, response_ids=responses[pick])
                        for pick in pick_responses(stored, batch.num_samples, batch.seed, index)]
        if batch.score_top_k is not None:
            for sample, output in zip(samples, self._score(batch.score_batch(samples)), strict=True):
                sample.output = output
        info = self.manifest.teacher["info"]
        vocab = info["tokenizer_size"] if info.get("tokenizer_size") is not None else info["vocab_size"]
        return check_generated(samples, batch, vocab, name=f"teacher cache {self.reader.directory}")

    def check_run(self, config, tokenizer, teacher=None) -> None:
        """Refuses a cache that does not belong to the run ``config`` describes (the trainer calls it at start-up;
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
        self._check_kind(config)
        if eval_enabled(config) and config.eval.kl:
            raise ValueError("eval.kl scores the student's own eval answers, which no teacher cache holds: set "
                             "eval.kl=false, or use a live teacher")
        manifest, teacher = self.manifest, teacher if teacher is not None else config.teacher
        self._check_bound(teacher)
        cross = teacher.cross_tokenizer.enabled
        pairs = {"tokenizer_digest": (manifest.tokenizer_digest, tokenizer_digest(tokenizer)),
                 # the teacher's own tokenizer, for a cache built for a pair (teacher.cross_tokenizer)
                 "teacher.cross_tokenizer.tokenizer": (
                     manifest.teacher_tokenizer_digest,
                     tokenizer_digest(load_tokenizer(teacher.tokenizer_source)) if cross else None),
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
        records = dataset_records(dataset) if self.generation is None else prompt_records(dataset)
        pairs["data.train_path"] = (manifest.dataset["blake3"], dataset_digest(records))
        if self.generation is not None:
            run = sampling_settings(config, stop_token_ids(config.rollout.stop_token_ids, tokenizer))
            pairs.update({name: (self.generation[key], run[key]) for key, name in SAMPLING_KEYS.items()})
        mismatches = [f"{field}: {cached!r} in the cache, {wanted!r} in this run"
                      for field, (cached, wanted) in pairs.items() if cached != wanted]
        if mismatches:
            raise ValueError(f"teacher cache {self.reader.directory} does not match this run (teacher "
                             f"{manifest.teacher.get('model')}, dataset {manifest.dataset.get('path')}): "
                             + "; ".join(mismatches) + ". Build a cache for this run (python -m "
                             "megatron_gkd.teacher.cache build --config CONFIG --out DIR) or point teacher.cache_dir "
                             "at one")
        logger.info("teacher cache %s matches this run (%d records of %s)", self.reader.directory,
                    manifest.dataset["num_records"], config.data.train_path)

    def _check_kind(self, config) -> None:
        """Refuses a run whose responses this kind of cache does not hold.

        Raises:
            ValueError: a run that samples without taking every response from the teacher, a run that takes them from
                the teacher with a cache of the dataset's responses (or the reverse), or one that asks for more
                responses per prompt than the cache holds.
        """
        mix, directory = config.sample_mix, self.reader.directory
        written = mix.enabled and mix.source == "teacher"
        if config.trainer.run_mode.samples and not written:
            raise ValueError("teacher.client=cache cannot score on-policy samples (they are new every step): use "
                             "trainer.mode=off_policy, or a live teacher (or, for sequence-level KD, a cache of "
                             "teacher-written responses with sample_mix.source=teacher sample_mix.lmbda=0)")
        if written and not mix.never_student(config.trainer.num_steps):
            raise ValueError(f"sample_mix.lmbda={mix.lmbda} (schedule {mix.schedule}) draws the student's own samples "
                             "at some step, which no teacher cache can score: a cache of teacher-written responses "
                             "serves sample_mix.lmbda=0 at every step only; use a live teacher for the mixture")
        if written and self.generation is None:
            raise ValueError(f"teacher cache {directory} holds the dataset's own responses scored, and "
                             "sample_mix.source=teacher trains on responses the teacher writes: build a cache of "
                             f"teacher-written responses from this run's config ({_BUILD}), or use a live teacher")
        if not written and self.generation is not None:
            raise ValueError(f"teacher cache {directory} holds responses the teacher wrote, which only a run with "
                             "sample_mix.source=teacher (and sample_mix.lmbda=0) trains on; build a cache of the "
                             f"dataset's responses for this run ({_BUILD}), or set sample_mix.source=teacher "
                             "sample_mix.lmbda=0")
        if written and config.rollout.n > self.generation["num_per_prompt"]:
            raise ValueError(f"rollout.n={config.rollout.n}: teacher cache {directory} holds "
                             f"{self.generation['num_per_prompt']} responses per prompt; rebuild it with "
                             f"{REBUILD_FLAG} {config.rollout.n} (or more), or lower rollout.n")

    def _check_bound(self, teacher) -> None:
        """Refuses a cache this run cannot bind to a teacher, unless ``teacher.cache_trust_unverified`` is set."""
        identity = self.manifest.teacher
        named = f"{identity.get('model')} (checkpoint blake3 {identity.get('checkpoint_blake3')})"
        named_by_run = teacher.checkpoint is not None or teacher.head_checkpoint is not None
        if (named_by_run or self.reader.verified) and teacher.cache_trust_unverified:
            logger.warning("teacher.cache_trust_unverified has no effect: this run binds cache %s to a teacher (by %s)",
                           self.reader.directory, "teacher.checkpoint" if named_by_run else "its manifest's MAC")
        if named_by_run:
            return  # the manifest's checkpoint digest is compared with the run's
        if self.reader.verified:
            logger.info("teacher cache %s: its manifest's MAC verifies with the run's secret; its teacher is %s (set "
                        "teacher.checkpoint=DIR to also check it is this run's)", self.reader.directory, named)
            return
        if teacher.cache_trust_unverified:
            logger.warning("teacher cache %s is used UNVERIFIED (teacher.cache_trust_unverified=true): nothing checks "
                           "that its teacher, %s, is this run's or that its manifest is unedited",
                           self.reader.directory, named)
            return
        raise ValueError(f"teacher cache {self.reader.directory} cannot be bound to a teacher: this run has no secret "
                         f"to check its manifest's MAC and no teacher.checkpoint to compare its teacher with (it names "
                         f"{named}). Set teacher.checkpoint=DIR (the teacher's checkpoint directory), or give the "
                         f"run's secret (teacher.secret_file or {SECRET_ENV}) if the cache was built with it, or set "
                         "teacher.cache_trust_unverified=true to use it unchecked")

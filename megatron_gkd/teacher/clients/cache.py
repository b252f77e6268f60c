"""``cache`` client: the teacher's answers read from a teacher cache (``teacher.cache_dir``), no teacher running.

A request is looked up by the blake3 of its token ids and response start (an index built when the cache is
opened), so any order, batching or data-parallel split of the dataset finds its rows; the outputs are the
arrays the live teacher's client returned when the cache was built, validated again. A sequence the cache
does not hold (an on-policy sample, an eval answer, a record of another dataset) fails naming the fix.

At start-up the trainer checks the cache against the run (:func:`megatron_gkd.trainer.cache_check.check_cache_run`,
the run's layer: it reads the run's config): it refuses a cache of another teacher, tokenizer, k, temperature, signal
or dataset, and one it cannot bind to a teacher (docs/teacher_cache.md, SECURITY.md).

A cache of teacher-written responses (:mod:`megatron_gkd.teacher.cache.generated`) also answers generate requests:
the stored responses of each prompt, looked up by its ids; their scores are then found by the same lookup as any
sequence's. It serves sequence-level KD only (``sample_mix.source=teacher``, ``sample_mix.lmbda`` 0 at every step).
"""

from __future__ import annotations

import logging
import threading

from megatron_gkd.teacher.cache.generated import (
    REBUILD_FLAG,
    pick_responses,
    setting_differences,
)
from megatron_gkd.teacher.cache.store import CacheReader
from megatron_gkd.teacher.clients import TeacherClient, TeacherInfo
from megatron_gkd.teacher.protocol.security import load_secret
from megatron_gkd.teacher.protocol.types import (
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

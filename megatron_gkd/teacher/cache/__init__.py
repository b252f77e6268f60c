"""A teacher cache: a dataset scored once by a teacher, then served from files with no teacher running.

Off-policy distillation (and the response side of it in every epoch) asks the teacher the same questions
again and again: the dataset's prompt + response records do not change. ``python -m megatron_gkd.teacher.cache
build`` asks once, through any teacher client the config's ``teacher`` section describes, and writes
safetensors shards beside a JSON manifest (docs/teacher_cache.md). ``teacher.client=cache`` with
``teacher.cache_dir=DIR`` then answers the trainer's requests from them
(:class:`~megatron_gkd.teacher.clients.cache.CacheTeacherClient`), after refusing a cache that does not
belong to the run (another teacher, tokenizer, k, temperature, signal or dataset).

A run of sequence-level KD (``sample_mix.source=teacher``, ``sample_mix.lmbda`` 0 at every step) builds a cache of
responses the teacher writes, which the client then also answers generate requests from.

Modules: :mod:`.store` (the file format, digests, the manifest), :mod:`.build` (the resumable scoring pass),
:mod:`.generated` (teacher-written responses: their settings, the writing pass, the choice among them),
``__main__`` (the command).
"""

from megatron_gkd.teacher.cache.store import CacheManifest, CacheReader, checkpoint_digest, dataset_digest

__all__ = ["CacheManifest", "CacheReader", "checkpoint_digest", "dataset_digest"]

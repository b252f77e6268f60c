"""Build a teacher cache: score a run's training data once through its teacher.

    python -m megatron_gkd.teacher.cache build --config configs/X.yaml [section.key=value ...] --out DIR

The config is the run's own (``launch/pretrain_gkd.py``): ``data`` (``train_path``, filtering) and
``student.tokenizer`` give the records exactly as the trainer tokenizes them; ``teacher`` names the teacher
(a service the command starts from ``teacher.serve.model``, or ``teacher.address`` / ``teacher.base_url``),
``top_k``, ``temperature``, ``signal`` and ``hidden_dtype``. Rerunning an interrupted command resumes it.
With the run's secret (``teacher.secret_file`` or $MEGATRON_GKD_TEACHER_SECRET) the manifest is signed, so runs
holding it can check that nobody edited it (SECURITY.md). Train from the cache with ``teacher.client=cache
teacher.cache_dir=DIR`` (docs/teacher_cache.md).

A config of sequence-level KD (``sample_mix.source=teacher``, ``sample_mix.lmbda`` 0 at every step) builds a cache
of teacher-WRITTEN responses instead (:mod:`.generated`): the teacher answers each prompt ``--responses-per-prompt``
times (default ``rollout.n``) with ``sample_mix.teacher.*``, seeded from ``rollout.seed``, ``--batch-size`` prompts
per request (default: the run's prompts per step), and the cache stores those responses with their scores.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
import sys

from megatron_gkd.config import load_config, needs_responses
from megatron_gkd.config.checks import teacher_response_limit
from megatron_gkd.data import load_prompts, load_tokenizer
from megatron_gkd.data.tokenization import stop_token_ids
from megatron_gkd.log_setup import setup_logging
from megatron_gkd.teacher.cache.build import build_cache, make_plan
from megatron_gkd.teacher.cache.generated import REBUILD_FLAG, generation_settings, prompt_records
from megatron_gkd.teacher.cache.store import CacheRecord, dataset_records
from megatron_gkd.teacher.clients import client_traits
from megatron_gkd.teacher.clients.cross_request import CrossTokenizer
from megatron_gkd.teacher.config import build_client_from_config
from megatron_gkd.teacher.protocol.security import SECRET_ENV, load_secret
from megatron_gkd.teacher.service.local import TeacherService

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_gkd.teacher.cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="score data.train_path through the teacher into DIR")
    build.add_argument("--config", help="the run's YAML preset (see configs/)")
    build.add_argument("overrides", nargs="*", metavar="section.key=value",
                       help="dotted overrides, e.g. teacher.top_k=64")
    build.add_argument("--out", required=True, help="the cache directory (created; an unfinished build there resumes)")
    build.add_argument("--records-per-shard", type=int, default=1024, help="records per shard file (default 1024)")
    build.add_argument("--batch-size", type=int,
                       help="sequences per teacher request (default 16); with sample_mix.source=teacher, prompts per "
                            "generate request (default: the run's prompts per step, trainer.global_batch_size / "
                            "rollout.n)")
    build.add_argument(REBUILD_FLAG, type=int, dest="responses_per_prompt",
                       help="with sample_mix.source=teacher: responses the teacher writes per prompt (default "
                            "rollout.n; a run may ask for as many or fewer)")
    build.add_argument("--teacher-checkpoint",
                       help="the teacher's checkpoint directory, hashed into the manifest (default "
                            "teacher.serve.model; give it when the teacher runs elsewhere, so runs can check the "
                            "cache is its)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    setup_logging("INFO")
    try:
        config = load_config(args.config, list(args.overrides))
    except ValueError as error:
        logger.error("config error: %s", error)
        return 2
    try:
        build(config, pathlib.Path(args.out), records_per_shard=args.records_per_shard, batch_size=args.batch_size,
              teacher_checkpoint=args.teacher_checkpoint, responses_per_prompt=args.responses_per_prompt)
    except ValueError as error:
        logger.error("%s", error)
        return 2
    return 0


def build(config, out: pathlib.Path, *, records_per_shard: int, batch_size: int | None, teacher_checkpoint: str | None,
          responses_per_prompt: int | None = None):
    """Loads the data, connects to (or starts) the teacher, and builds the cache (of the teacher's own responses when
    the run's come from it, ``sample_mix.source=teacher``); stops the teacher at the end."""
    teacher = config.teacher
    if not teacher.enabled or not client_traits(teacher.client).fills_cache:
        raise ValueError(f"teacher.client={teacher.client}: the cache is built through a teacher service or "
                         "server; set teacher.client=zmq with teacher.serve.model=DIR (or teacher.address), or "
                         "teacher.client=openai")
    # The run's secret signs the manifest (a service this command starts gets a secret of its own, below).
    secret = load_secret(teacher.secret_file)
    if secret is None:
        logger.warning("no secret (teacher.secret_file or %s): the cache's manifest is not signed, so a run can check "
                       "it only against teacher.checkpoint", SECRET_ENV)
    tokenizer = load_tokenizer(config.student.tokenizer_path)
    generation = _generation(config, tokenizer, batch_size, responses_per_prompt)
    # Loaded as the run loads it: with sample_mix.source=teacher the records need no response; a teacher of another
    # tokenizer reads each record's conversation through its own chat template (megatron_gkd.teacher.clients.cross_prompt).
    cross = teacher.cross_tokenizer
    dataset = load_prompts(config.data.train_path, config.data, tokenizer, require_responses=needs_responses(config),
                           show_progress=True, keep_conversations=cross.enabled and cross.prompt == "template")
    records = dataset_records(dataset) if generation is None else prompt_records(dataset)
    service = service_secret = None
    try:
        if teacher.serve.model is not None:
            service = TeacherService(teacher.serve, out.with_name(out.name + ".teacher_service.log"))
            address = service.wait_ready(teacher.serve.startup_timeout_s)
            service_secret = service.secret.encode()
            teacher_checkpoint = teacher_checkpoint or teacher.serve.model
            # The client talks to the service (the hidden signal's head checkpoint is the run's business).
            teacher = dataclasses.replace(teacher, address=address,
                                          serve=dataclasses.replace(teacher.serve, model=None),
                                          head_checkpoint=teacher.head_source if teacher.signal.needs_head else None)
        return _score(teacher, config, tokenizer, records, out, records_per_shard=records_per_shard,
                      batch_size=batch_size or 16, teacher_checkpoint=teacher_checkpoint,
                      service_secret=service_secret, secret=secret, generation=generation, dataset=dataset)
    finally:
        if service is not None:
            service.stop()


def _generation(config, tokenizer, batch_size: int | None, responses_per_prompt: int | None) -> dict | None:
    """The generation settings of a run whose responses the teacher writes (``sample_mix.source=teacher``), else
    None (a cache of the dataset's own responses).

    Raises:
        ValueError: the run would also need the student's own samples scored (``sample_mix.lmbda`` > 0 at some step),
            which no cache holds; or it has no seed to record; or ``--responses-per-prompt`` is given for a cache of
            the dataset's responses.
    """
    mix = config.sample_mix
    if not (mix.enabled and mix.source_traits.teacher_writes):
        if responses_per_prompt is not None:
            raise ValueError(f"{REBUILD_FLAG} applies to a cache of teacher-written responses (the run's config with "
                             "sample_mix.source=teacher and sample_mix.lmbda=0)")
        return None
    if not mix.never_student(config.trainer.num_steps):
        raise ValueError(f"sample_mix.lmbda={mix.lmbda} (schedule {mix.schedule}) draws the student's own samples at "
                         "some step, which a teacher cache cannot score; a cache of teacher-written responses serves "
                         "sequence-level KD only: sample_mix.lmbda=0 at every step")
    if config.rollout.seed is None:
        raise ValueError("a cache of teacher-written responses records the seed they were written with: set "
                         "rollout.seed=N (the run's batch r is then seeded as the build's request r)")
    prompts_per_step = config.trainer.global_batch_size // config.rollout.n
    return generation_settings(config.sample_mix.teacher, teacher_response_limit(config),
                               stop_token_ids(config.rollout.stop_token_ids, tokenizer),
                               num_per_prompt=responses_per_prompt or config.rollout.n,
                               prompts_per_request=batch_size or prompts_per_step, seed=config.rollout.seed)


def _score(teacher, config, tokenizer, records, out, *, records_per_shard, batch_size, teacher_checkpoint,
           service_secret, secret, generation=None, dataset=None):
    client = build_client_from_config(teacher, service_secret)
    # The run's section: it still names the served model (the teacher's tokenizer).
    cross = CrossTokenizer.of_teacher(config.teacher, tokenizer, len(tokenizer))
    try:
        identity = {"client": teacher.client, "model": str(teacher_checkpoint or teacher.address or teacher.base_url),
                    "backend": config.teacher.serve.backend if config.teacher.serve.model else None}
        plan = make_plan(client.info(), identity, teacher_checkpoint=teacher_checkpoint, tokenizer=tokenizer,
                         records=records, data_path=str(config.data.train_path), top_k=teacher.top_k,
                         temperature=teacher.temperature, signal=teacher.signal, hidden_dtype=teacher.hidden_dtype,
                         records_per_shard=records_per_shard, cross=cross, generation=generation)
        if cross is not None:  # scored as the trainer asks: the records' text in the teacher's own ids
            cross.prompts.learn(dataset)
            records = [CacheRecord(r.index, *_teacher_side(cross, r)) for r in records]
        return build_cache(client, records, out, plan, batch_size=batch_size, show_progress=True, secret=secret)
    finally:
        client.close()


def _teacher_side(cross, record):
    sequence = cross.translate(record.token_ids, record.response_start).sequence
    return sequence.token_ids, sequence.response_start


if __name__ == "__main__":
    sys.exit(main())

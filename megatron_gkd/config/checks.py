"""Checks that span config sections: each failure names the keys involved and the fix.

:func:`check_config` runs when a :class:`~megatron_gkd.config.GKDConfig` is built (no process or world
needed); :func:`check_layout` adds what depends on the world size (``--dry-run`` and start-up).
Options that have no effect on the chosen path are logged as warnings (``inert``).
"""

from __future__ import annotations

import dataclasses
import logging

from megatron_gkd import platform
from megatron_gkd.config.partial import check_partial
from megatron_gkd.config.sample_mix import SampleMixConfig
from megatron_gkd.losses.advantages import get_advantage_estimator
from megatron_gkd.losses.registry import cross_tokenizer_divergences, dense_divergences
from megatron_gkd.planning.model import model_shape, read_config
from megatron_gkd.rewards.config import check_reward_settings
from megatron_gkd.rollout.registry import ENGINES, engine_traits
from megatron_gkd.rollout.types import Layout
from megatron_gkd.teacher.backends import backend_names, backend_traits
from megatron_gkd.teacher.clients import client_names, client_traits

logger = logging.getLogger(__name__)


def teacher_configs(config) -> dict:
    """The run's teachers by name: ``teachers`` when set, else ``teacher`` as the one teacher named
    ``teacher`` (nothing when it is ``client: none``)."""
    if config.teachers:
        return dict(config.teachers)
    return {"teacher": config.teacher} if config.teacher.enabled else {}


def teacher_key(config, name: str) -> str:
    """How messages name a teacher's config section (``teacher`` or ``teachers.NAME``)."""
    return f"teachers.{name}" if config.teachers else "teacher"


def needs_teacher(config) -> bool:
    return config.trainer.run_mode.distills


def needs_responses(config) -> bool:
    """The records must carry reference responses: trained on (off_policy, sft) or mixed in (``sample_mix.source=
    dataset``)."""
    mix = config.sample_mix
    return not config.trainer.run_mode.samples or (mix.enabled and mix.source_traits.from_records)


def teacher_response_limit(config) -> int:
    """The longest response the teacher writes for ``sample_mix.source=teacher``."""
    return config.sample_mix.teacher.max_tokens or config.rollout.max_tokens


def student_samples(config) -> bool:
    """The student samples training batches: on-policy, unless GKD's mixture never draws its samples (``sample_mix``
    with ``lmbda`` 0 throughout: every response is the teacher's or the dataset's)."""
    return config.trainer.run_mode.samples and not config.sample_mix.never_student(config.trainer.num_steps)


def needs_rollout(config) -> bool:
    """The rollout engine samples training batches (:func:`student_samples`) or eval answers."""
    return student_samples(config) or eval_enabled(config)


def eval_enabled(config) -> bool:
    evaluation = config.eval
    return config.data.eval_path is not None and (evaluation.interval is not None or evaluation.at_start
                                                  or evaluation.at_end)


def _fail(message: str) -> None:
    raise ValueError(message)


def _default(section, key: str):
    """The schema's default of ``key`` in ``section`` (a config dataclass): an option left at it was not chosen."""
    return next(field.default for field in dataclasses.fields(section) if field.name == key)


def check_config(config) -> None:
    """Static cross-section checks (see the module docstring).

    Raises:
        ValueError: the first inconsistency found, naming its keys and the fix.
    """
    trainer, rollout, loss, data = config.trainer, config.rollout, config.loss, config.data
    teachers = teacher_configs(config)
    # A user's module:function (eval.function, reward.function) is imported by megatron_gkd.trainer.checks, which
    # the entry points run: loading a config imports no user code.
    if rollout.engine not in ENGINES:
        raise ENGINES.unknown(rollout.engine)
    if config.student.checkpoint is None:
        _fail("student.checkpoint is required: the HF checkpoint directory of the student's initial weights")
    if data.train_path is None:
        _fail("data.train_path is required: a .jsonl or .parquet file of prompts")
    if needs_teacher(config) and not teachers:
        _fail(f"trainer.mode={trainer.mode} needs a teacher: set teacher.client=zmq with teacher.address=tcp://HOST:PORT, "
              "or teacher.client=zmq with teacher.serve.model=DIR to start one on loopback, or use trainer.mode=sft")
    if trainer.run_mode.samples and trainer.global_batch_size % rollout.n:
        _fail(f"trainer.global_batch_size={trainer.global_batch_size} samples is not a multiple of rollout.n={rollout.n} "
              f"samples per prompt; use a multiple of {rollout.n}")
    if not trainer.run_mode.samples and rollout.n != 1:
        _fail(f"rollout.n={rollout.n} samples per prompt only applies to trainer.mode=on_policy ({trainer.mode} trains "
              "on one dataset response per prompt); set rollout.n=1")
    topk_teachers = any(teacher.signal.sends_topk for teacher in teachers.values())
    if loss.divergence.student_support and trainer.run_mode.samples and rollout.logprobs_k < 1 and topk_teachers:
        _fail(f"loss.type={loss.type} interleaves the teacher's top-k with the student's: set rollout.logprobs_k=K "
              "(the student's top-k ids returned by the rollout engine), e.g. rollout.logprobs_k=8")
    if loss.divergence.student_support and not trainer.run_mode.samples:
        _fail(f"loss.type={loss.type} needs the student's top-k ids of sampled responses, which only trainer.mode=on_policy "
              f"has (it is {trainer.mode}); use another loss.type, e.g. forward_kl")
    for name, teacher in teachers.items():
        _check_teacher(config, teacher, teacher_key(config, name))
        _check_temperature(config, teacher, teacher_key(config, name))
    _check_teacher_mix(config, teachers)
    if data.max_prompt_length + rollout.max_tokens > rollout.max_model_len and needs_rollout(config):
        _fail(f"data.max_prompt_length={data.max_prompt_length} + rollout.max_tokens={rollout.max_tokens} exceeds "
              f"rollout.max_model_len={rollout.max_model_len}; raise rollout.max_model_len or lower the other two")
    if config.eval.interval is not None and data.eval_path is None:
        _fail("eval.interval is set but data.eval_path is not: give held-out prompts (with answers) or set "
              "eval.interval=null")
    if trainer.max_tokens_per_microbatch is not None:
        longest = data.max_prompt_length + (rollout.max_tokens if trainer.run_mode.samples else
                                            data.max_response_length or 0)
        if config.sample_mix.enabled and config.sample_mix.source_traits.teacher_writes:
            longest = max(longest, data.max_prompt_length + teacher_response_limit(config))
        if data.max_response_length is None and not trainer.run_mode.samples:
            longest = 0  # unknown until the data is read; checked per batch
        if longest > trainer.max_tokens_per_microbatch:
            _fail(f"trainer.max_tokens_per_microbatch={trainer.max_tokens_per_microbatch} is smaller than the longest "
                  f"possible sample ({longest} tokens: data.max_prompt_length + the response limit); raise it")
    _check_rl(config, teachers)
    _check_sample_mix(config, teachers)
    _check_rollout_engine(config)
    _check_weight_sync(config)
    check_partial(config)
    _check_inert(config)


def _check_rl(config, teachers: dict) -> None:
    """The policy-gradient term against the mode, the rewards, the sampling and the teachers."""
    rl = config.rl
    combination = rl.combination
    if combination is None:
        if rl.num_updates > 1:
            logger.warning("rl.ppo_epochs / rl.mini_batches have no effect without rl.combine (the divergence alone "
                           "takes one optimizer step per batch)")
        if rl.kd_coef_end is not None:
            logger.warning("rl.kd_coef_end has no effect without rl.combine (the divergence alone is the loss)")
        if rl.dynamic_sampling:
            logger.warning("rl.dynamic_sampling has no effect without rl.combine (nothing trains on the rewards)")
        return
    if rl.num_updates == 1 and (rl.clip_ratio_c is not None or rl.clip_low != _default(rl, "clip_low")
                                or rl.clip_high != _default(rl, "clip_high")):
        logger.warning("rl.clip_low / rl.clip_high / rl.clip_ratio_c have no effect with one update per batch "
                       "(rl.ppo_epochs=1, rl.mini_batches=1): the ratio pi / pi_old is 1; raise rl.ppo_epochs or "
                       "rl.mini_batches for the clip to act")
    if not config.trainer.run_mode.samples:
        _fail(f"rl.combine={rl.combine!r} trains on the student's own samples with their rewards, which only "
              f"trainer.mode=on_policy has (it is {config.trainer.mode}); set trainer.mode=on_policy or rl.combine=null")
    if combination.uses_reward:
        if not config.reward.enabled:
            _fail(f"rl.combine={rl.combine!r} trains on rewards but reward.kind is null (a reward without a verifier): "
                  "set reward.kind (final_answer, math_answer, regex, or function with reward.function=module:function),"
                  " or rl.combine=teacher for the teacher's signal alone")
        check_reward_settings(config.reward, config.rollout.n, get_advantage_estimator(rl.advantage),
                              advantage_key="rl.advantage")
    elif config.reward.enabled:
        logger.warning("rl.combine=teacher trains on the teacher's signal alone: reward.kind=%r is computed and "
                       "logged (reward/*), not trained on", config.reward.kind)
    if combination.teacher_in_advantage:
        if not combination.uses_reward and 0 in (rl.kd_coef, rl.kd_coef_end):
            key = "rl.kd_coef" if rl.kd_coef == 0 else "rl.kd_coef_end"
            _fail(f"rl.combine={rl.combine!r} with {key}=0 trains on nothing (reward 0, the teacher weighed 0): "
                  f"set {key} > 0, e.g. 1.0")
        for name, teacher in teachers.items():
            if not client_traits(teacher.client).token_logprobs:
                _fail(f"rl.combine={rl.combine!r} reads the teacher's log-prob of each sampled token, which "
                      f"{teacher_key(config, name)}.client={teacher.client!r} does not return: use rl.combine=loss "
                      "(the divergence over its rows) or a client that returns token log-probs (zmq, openai)")
    if rl.teacher_baseline and not combination.teacher_in_advantage:
        logger.warning("rl.teacher_baseline has no effect with rl.combine=%s (the teacher is not in the advantage)",
                       rl.combine)
    elif rl.teacher_baseline and config.rollout.temperature != 1.0:
        _fail(f"rl.teacher_baseline reads k1 from the rollout engine's raw (temperature 1) log-probs, but "
              f"rollout.temperature={config.rollout.temperature}: set rollout.temperature=1 or rl.teacher_baseline=false")
    elif rl.teacher_baseline and config.rollout.n < 2:
        _fail("rl.teacher_baseline is the mean k1 of the other samples of a prompt, but rollout.n=1 gives none: set "
              "rollout.n >= 2 or rl.teacher_baseline=false")
    if rl.tis_cap is not None and config.rollout.temperature != 1.0:
        _fail(f"rl.tis_cap weighs by pi_train / pi_rollout with the rollout engine's raw (temperature 1) log-probs, "
              f"but rollout.temperature={config.rollout.temperature}: set rollout.temperature=1 or rl.tis_cap=null")
    _check_dynamic_sampling(config)


def _check_dynamic_sampling(config) -> None:
    """DAPO's dynamic sampling against the combination, the advantage estimator and the rollout's layout (partial
    rollouts and GKD's mixture refuse ``rl.combine`` altogether)."""
    rl = config.rl
    if not rl.dynamic_sampling:
        if rl.dynamic_sampling_max_rounds != _default(rl, "dynamic_sampling_max_rounds"):
            logger.warning("rl.dynamic_sampling_max_rounds has no effect without rl.dynamic_sampling=true")
        return
    fix = "or set rl.dynamic_sampling=false"
    if not rl.combination.uses_reward:
        _fail(f"rl.dynamic_sampling drops prompt groups whose rewards are all equal, but rl.combine={rl.combine!r} "
              f"trains on no reward: use rl.combine=loss or rl.combine=advantage with reward.kind, {fix}")
    if get_advantage_estimator(rl.advantage).min_group_size < 2:
        _fail(f"rl.dynamic_sampling drops groups whose advantages are 0 because their rewards are all equal, which "
              f"holds for estimators with a group baseline; rl.advantage={rl.advantage!r} has none (its advantage is "
              f"the reward itself): use rl.advantage=grpo, rloo or dr_grpo, {fix}")
    if not config.rollout.layout.in_trainer:
        _fail(f"rl.dynamic_sampling samples and rewards a batch round by round before the teacher is asked, which the "
              f"rollout server's background sampling (rollout.layout={config.rollout.layout.value}) does not do: use "
              f"rollout.layout=colocated, {fix}")


def _check_sample_mix(config, teachers: dict) -> None:
    """GKD's mixture against the mode, the loss, the policy gradient and the teacher that writes responses."""
    mix = config.sample_mix
    if not mix.enabled:
        if mix != SampleMixConfig():
            logger.warning("sample_mix.* has no effect while sample_mix.lmbda is null (no mixture)")
        return
    for option in mix.inert_options():
        logger.warning("%s has no effect with sample_mix.schedule=%s, sample_mix.source=%s", option, mix.schedule,
                       mix.source)
    trainer = config.trainer
    if not trainer.run_mode.samples or not trainer.run_mode.distills:
        _fail(f"sample_mix.lmbda mixes the student's own samples with {mix.source} responses, which needs "
              f"trainer.mode=on_policy (it is {trainer.mode}); set trainer.mode=on_policy, or sample_mix.lmbda=null "
              "to train on the dataset's responses alone")
    if config.rl.enabled:
        _fail(f"sample_mix.lmbda with rl.combine={config.rl.combine!r}: the policy gradient is on-policy (the "
              f"student's samples and their rewards), and {mix.source} responses are not the student's; set "
              "sample_mix.lmbda=null or rl.combine=null")
    if config.loss.divergence.student_support:
        _fail(f"loss.type={config.loss.type} needs the student's top-k ids of each response, which {mix.source} responses "
              "(sample_mix.source) do not have; use another loss.type (e.g. forward_kl) or sample_mix.lmbda=null")
    if not mix.source_traits.teacher_writes:
        return
    name = mix.teacher.teacher
    if name is None and len(teachers) > 1:
        _fail(f"sample_mix.source=teacher with several teachers ({sorted(teachers)}): name the one that writes the "
              f"responses, e.g. sample_mix.teacher.teacher={sorted(teachers)[0]}")
    if name is not None and name not in teachers:
        _fail(f"sample_mix.teacher.teacher={name!r} is not one of the run's teachers {sorted(teachers)}"
              + ("" if config.teachers else " (a single `teacher` section is named 'teacher'; or leave it null)"))
    name = name or next(iter(teachers))
    teacher = teachers[name]
    if teacher.cross_tokenizer.enabled:
        _fail(f"sample_mix.source=teacher trains the student on the teacher's responses, which "
              f"{teacher_key(config, name)} (another tokenizer: cross_tokenizer.method) writes in its own ids; use "
              "sample_mix.source=dataset, or a teacher of the student's tokenizer")
    traits = client_traits(teacher.client)
    if traits.from_files and mix.never_student(config.trainer.num_steps):
        return  # a cache of teacher-written responses (sequence-level KD); trainer/cache_check.py compares it at start-up
    if not traits.generates:
        _fail(f"sample_mix.source=teacher asks the teacher for responses, which "
              f"{teacher_key(config, name)}.client={teacher.client!r} cannot do; use {teacher_key(config, name)}"
              ".client=zmq (a teacher service with the hf, vllm or megatron backend) or openai, or "
              "sample_mix.source=dataset" + (" (a cache of teacher-written responses serves sample_mix.lmbda=0 at "
                                             "every step only: it holds no scores of the student's own samples)"
                                             if traits.from_files else ""))


def generating_teacher(config) -> str | None:
    """The name of the teacher that writes responses (``sample_mix.source=teacher``), else None."""
    mix = config.sample_mix
    if not mix.enabled or not mix.source_traits.teacher_writes:
        return None
    return mix.teacher.teacher or next(iter(teacher_configs(config)))


# weight_sync.verify's least tolerance for a bf16/fp16 student or engine: 3x the largest |vLLM - Megatron|
# prompt log-prob error measured after bf16 syncs of the tiny student (0.081; tests/e2e/trainer/test_bf16.py).
LOW_PRECISION_VERIFY_TOLERANCE = 0.25


def _check_rollout_engine(config) -> None:
    """What the chosen engine can do (its :class:`~megatron_gkd.rollout.registry.EngineTraits`)."""
    rollout = config.rollout
    if not needs_rollout(config):
        return
    traits = engine_traits(rollout.engine)
    if not traits.tensor_parallel and rollout.tensor_parallel_size != 1:
        _fail(f"rollout.tensor_parallel_size={rollout.tensor_parallel_size}: rollout.engine={rollout.engine} holds the "
              "whole model on every rank (each rank is a replica that samples its share of the prompts); set "
              "rollout.tensor_parallel_size=1, or use rollout.engine=vllm to split the model")
    if rollout.release_weights and not (traits.releases_weights and rollout.layout.in_trainer):
        _fail(f"rollout.release_weights=true: rollout.engine={rollout.engine} with rollout.layout={rollout.layout} "
              "cannot release its weights between syncs (only the hf engine, colocated, can); set "
              "rollout.release_weights=null (or false), or rollout.engine=hf")
    if not traits.serves_remote and rollout.layout.sends_weights:
        _fail(f"rollout.layout=disaggregated: rollout.engine={rollout.engine} runs colocated only (one replica on every "
              "trainer rank); set rollout.layout=colocated, or use rollout.engine=vllm on a rollout server")


def _check_weight_sync(config) -> None:
    rollout, sync, parallel = config.rollout, config.weight_sync, config.parallel
    if not needs_rollout(config):
        return
    own_weights = not engine_traits(rollout.engine).shares_student_weights
    if not own_weights and not rollout.layout.in_trainer:
        _fail(f"rollout.engine={rollout.engine} samples with the student itself: it needs rollout.layout=colocated")
    if not own_weights and parallel.pipeline_model_parallel_size > 1:
        _fail(f"rollout.engine={rollout.engine} needs parallel.pipeline_model_parallel_size=1; use rollout.engine=vllm")
    if rollout.layout.in_trainer and own_weights and sync.transport != rollout.layout.transport:
        _fail(f"rollout.layout=colocated loads weights in-process: set weight_sync.transport=colocated (it is "
              f"{sync.transport!r}), or rollout.layout=disaggregated to send them to a rollout server")
    if rollout.layout.sends_weights and sync.transport != rollout.layout.transport:
        _fail("rollout.layout=disaggregated sends weights to the rollout server: set weight_sync.transport=distributed")
    low_precision = {config.student.dtype, rollout.dtype or config.student.dtype} - {"float32"}
    if (own_weights and sync.verify and low_precision
            and sync.verify_tolerance < LOW_PRECISION_VERIFY_TOLERANCE):
        _fail(f"weight_sync.verify compares vLLM's prompt log-probs with the student's, and in {min(low_precision)} "
              "the two implementations differ by up to 0.08 with the same weights (measured on the tiny assets), "
              f"above weight_sync.verify_tolerance={sync.verify_tolerance}: set "
              f"weight_sync.verify_tolerance={LOW_PRECISION_VERIFY_TOLERANCE} (it then catches missing or garbled "
              "weights, not a step of staleness) or weight_sync.verify=false")
    if sync.transport == Layout.COLOCATED.transport and parallel.pipeline_model_parallel_size > 1:
        # Experts split over expert parallelism are gathered for the engine; pipeline stages are not.
        _fail("weight_sync.transport=colocated needs parallel.pipeline_model_parallel_size=1 (each rank's vLLM shard "
              "needs every layer, but a rank holds only its stage's weights); use rollout.layout=disaggregated with "
              "weight_sync.transport=distributed")


def _check_inert(config) -> None:
    loss, trainer, rollout = config.loss, config.trainer, config.rollout
    if not trainer.run_mode.distills and loss.type != _default(loss, "type"):
        logger.warning("loss.type=%s has no effect in trainer.mode=sft (cross-entropy on dataset responses)", loss.type)
    if not loss.divergence.student_support and (loss.support_k is not None or loss.support_mode != "interleave"):
        logger.warning("loss.support_k / loss.support_mode have no effect with loss.type=%s (tcad only)", loss.type)
    elif loss.support_mode == "union" and loss.support_k is not None:
        logger.warning("loss.support_k has no effect with loss.support_mode=union (the support is both top-k lists "
                       "whole: teacher.top_k + rollout.logprobs_k ids)")
    rl_without_divergence = config.rl.combination is not None and not config.rl.combination.uses_divergence
    if loss.tail_bucket and (not trainer.run_mode.distills or rl_without_divergence):
        logger.warning("loss.tail_bucket has no effect: no divergence is trained on (trainer.mode=%s, rl.combine=%s)",
                       trainer.mode, config.rl.combine)
    if not loss.fused and loss.chunk_size != 1024:
        logger.warning("loss.chunk_size has no effect without loss.fused=true")
    if trainer.max_tokens_per_microbatch is not None and trainer.micro_batch_size != 1:
        logger.warning("trainer.micro_batch_size has no effect with trainer.max_tokens_per_microbatch (dynamic batching)")
    mindspeed = config.mindspeed
    if config.parallel.context_parallel_size == 1 and (mindspeed.context_parallel_algo != "megatron_cp_algo"
                                                       or mindspeed.ulysses_degree_in_cp is not None):
        logger.warning("mindspeed.context_parallel_algo / mindspeed.ulysses_degree_in_cp have no effect with "
                       "parallel.context_parallel_size=1 (they choose how attention is split over context-parallel ranks)")
    elif mindspeed.ulysses_degree_in_cp is not None and mindspeed.context_parallel_algo != "hybrid_cp_algo":
        logger.warning("mindspeed.ulysses_degree_in_cp has no effect with mindspeed.context_parallel_algo=%s "
                       "(hybrid_cp_algo only)", mindspeed.context_parallel_algo)
    if needs_rollout(config) and not engine_traits(rollout.engine).vllm_options and (
            rollout.gpu_memory_utilization != _default(rollout, "gpu_memory_utilization")
            or rollout.kv_cache_memory_mb is not None):
        logger.warning("rollout.gpu_memory_utilization / rollout.kv_cache_memory_mb have no effect with rollout.engine=%s "
                       "(vLLM's memory reservation; this engine's KV cache grows with the batch)", rollout.engine)
    if rollout.layout.in_trainer and trainer.schedule.max_staleness > 0:
        logger.info("trainer.scheduler=%s with a colocated rollout overlaps teacher scoring with training; "
                    "rollout itself runs on the training ranks between updates", trainer.scheduler)


def check_layout(config, world_size: int) -> dict:
    """Checks what depends on the world size and returns the batch plan.

    Returns:
        ``{"data_parallel_size", "samples_per_rank", "prompts_per_step", "prompts_per_rank",
        "rollout_replicas"}``.

    Raises:
        ValueError: the layout does not fit ``world_size`` or the batch does not split (with the fix).
    """
    parallel, trainer, rollout = config.parallel, config.trainer, config.rollout
    if parallel.context_parallel_size != 1:
        _fail("parallel.context_parallel_size > 1 is not supported by the trainer yet; set it to 1")
    dp = parallel.data_parallel_size(world_size)
    n = rollout.n if trainer.run_mode.samples else 1
    prompts = trainer.global_batch_size // n
    if prompts % dp:
        _fail(f"trainer.global_batch_size={trainer.global_batch_size} ({prompts} prompts x {n} samples) does not split "
              f"over data-parallel size {dp} with each prompt's samples on one rank: use a multiple of {dp * n} samples")
    per_rank = trainer.global_batch_size // dp
    if trainer.max_tokens_per_microbatch is None and per_rank % trainer.micro_batch_size:
        _fail(f"trainer.global_batch_size={trainer.global_batch_size} gives {per_rank} samples per data-parallel rank "
              f"(dp={dp}), not a multiple of trainer.micro_batch_size={trainer.micro_batch_size}; use a global batch "
              f"that is a multiple of dp x micro_batch_size = {dp * trainer.micro_batch_size}, or "
              "trainer.max_tokens_per_microbatch")
    replicas = 1
    if needs_rollout(config) and rollout.layout.in_trainer and not engine_traits(rollout.engine).shares_student_weights:
        if world_size % rollout.tensor_parallel_size:
            _fail(f"rollout.tensor_parallel_size={rollout.tensor_parallel_size} must divide the world size {world_size} "
                  "in the colocated layout (every rank holds a vLLM shard)")
        replicas = world_size // rollout.tensor_parallel_size
        if prompts % replicas:
            _fail(f"{prompts} prompts per step do not split over {replicas} colocated {rollout.engine} replicas (world "
                  f"{world_size} / rollout.tensor_parallel_size {rollout.tensor_parallel_size}); use a multiple of "
                  f"{replicas * n} samples in trainer.global_batch_size or a larger rollout.tensor_parallel_size")
        if replicas > 1 and platform.detect() == "cpu" and _student_is_moe(config):
            _fail(f"an MoE student cannot sample with {replicas} colocated vLLM replicas on the CPU "
                  f"(rollout.tensor_parallel_size={rollout.tensor_parallel_size} of world size {world_size}): vLLM's "
                  "data parallelism dispatches experts with an all-gatherv its CPU communicator lacks, and fails at "
                  f"the first generate; set rollout.tensor_parallel_size={world_size} (one engine over all ranks)")
    return dict(data_parallel_size=dp, samples_per_rank=per_rank, prompts_per_step=prompts,
                prompts_per_rank=prompts // dp, rollout_replicas=replicas)


def _student_is_moe(config) -> bool:
    """Whether the student's HF checkpoint is a mixture of experts; False when it cannot be read yet."""
    try:
        return model_shape(read_config(config.student.checkpoint)).is_moe
    except (FileNotFoundError, KeyError, ValueError):
        return False


def _check_teacher(config, teacher, key: str) -> None:
    """What one teacher must offer this run (``key``: its config section, ``teacher`` or ``teachers.NAME``)."""
    trainer, loss = config.trainer, config.loss
    if config.teachers and not teacher.enabled:
        _fail(f"{key}.client is not set (it is {teacher.client!r}): every teacher in `teachers` needs a client, e.g. "
              f"{key}.client=zmq with {key}.address=tcp://HOST:PORT or {key}.serve.model=DIR")
    backend = teacher.serve.backend if teacher.serve.model is not None else None  # a service the run starts
    served = backend_traits(backend) if backend is not None else None
    if loss.divergence.student_support and teacher.signal.sends_topk and served is not None and not served.requested_ids:
        able = " or ".join(name for name in backend_names() if backend_traits(name).requested_ids)
        _fail(f"loss.type={loss.type} scores the teacher at the student's top-k ids, which {key}.serve.backend="
              f"{backend} cannot do; use {key}.serve.backend={able}")
    traits = client_traits(teacher.client) if teacher.enabled else None
    if loss.divergence.student_support and teacher.signal.sends_topk and traits is not None and not traits.requested_ids:
        _fail(f"loss.type={loss.type} scores the teacher at the student's top-k ids, which {traits.description} "
              f"cannot do; use {key}.client=zmq with an hf or megatron backend, or {key}.client=local")
    if served is not None and teacher.signal not in served.signals:
        able = " or ".join(name for name in backend_names() if teacher.signal in backend_traits(name).signals)
        _fail(f"{key}.signal={teacher.signal} needs the teacher's final hidden states, which {key}.serve.backend="
              f"{backend} cannot return; use {key}.serve.backend={able}, or {key}.signal=topk")
    if traits is not None and teacher.signal not in traits.signals:
        _fail(f"{key}.signal={teacher.signal} needs the teacher's final hidden states, which {traits.description} "
              f"cannot return; use {key}.client=zmq with {key}.serve.backend=hf or megatron, or "
              f"{key}.client=local, or {key}.signal=topk")
    if not trainer.run_mode.distills and not eval_enabled(config):
        logger.warning("%s.* has no effect in trainer.mode=sft without eval (it is only used for eval's KL)", key)
    if teacher.signal.sends_hidden and not teacher.cross_tokenizer.enabled and loss.divergence.dense is None:
        _fail(f"loss.type={loss.type} has no full-vocabulary form for {key}.signal=hidden; use {key}.signal=topk, or "
              f"loss.type={' or '.join(dense_divergences())}")
    if loss.tail_bucket and teacher.signal.sends_hidden and not teacher.cross_tokenizer.enabled:
        logger.warning("loss.tail_bucket has no effect with %s.signal=hidden (the divergence is over the teacher's "
                       "whole distribution, with no mass left outside)", key)
    if traits is not None and traits.reads_student and config.parallel.pipeline_model_parallel_size > 1:
        _fail(f"{key}.client={teacher.client} scores with the student's own chunks, which is not built or tested with "
              "pipeline parallelism; set parallel.pipeline_model_parallel_size=1, or use a separate teacher "
              f"({key}.client=local with {key}.checkpoint=DIR of the student's checkpoint)")
    if teacher.enabled and teacher.cross_tokenizer.enabled:
        _check_cross_tokenizer(config, teacher, key)
    elif teacher.enabled and teacher.cross_tokenizer.hidden_support.whole_vocabulary:
        logger.warning("%s.cross_tokenizer.hidden_support=%s has no effect without %s.cross_tokenizer.method (a teacher "
                       "of the student's tokenizer with signal=hidden is always compared over its whole vocabulary)",
                       key, teacher.cross_tokenizer.hidden_support, key)
    if teacher.enabled and not teacher.cross_tokenizer.enabled and teacher.cross_tokenizer.prompt != "template":
        logger.warning("%s.cross_tokenizer.prompt=%s has no effect without %s.cross_tokenizer.method (a teacher of the "
                       "student's tokenizer reads the student's prompt ids)", key, teacher.cross_tokenizer.prompt, key)


def _check_cross_tokenizer(config, teacher, key: str) -> None:
    """What a teacher of another tokenizer (``cross_tokenizer.method``) can be used for today (docs/running.md)."""
    where = f"{key}.cross_tokenizer.method={teacher.cross_tokenizer.method}"
    if teacher.tokenizer_source is None:
        _fail(f"{where} needs the teacher's tokenizer: set {key}.cross_tokenizer.tokenizer=DIR (its HF tokenizer "
              "directory)")
    if config.loss.divergence.student_support:
        _fail(f"{where}: loss.type={config.loss.type} has no cross-tokenizer form (its support is the student's own top-k, which the "
              f"teacher would have to score through the inverse map); use {', '.join(cross_tokenizer_divergences())}")
    if config.loss.tail_bucket:
        _fail(f"{where}: loss.tail_bucket has no cross-tokenizer form (the student's mass outside the teacher's ids "
              "through the projection is not computed); set loss.tail_bucket=false")
    if teacher.signal.sends_hidden and teacher.cross_tokenizer.inside_groups == "chain":
        _fail(f"{where} with {key}.signal=hidden: the chain rule reads the teacher's top-k where the teacher is asked, "
              f"which the hidden signal makes only in the step; set {key}.cross_tokenizer.inside_groups=skip, or "
              f"{key}.signal=topk")
    if teacher.cross_tokenizer.hidden_support.whole_vocabulary:
        _check_full_support(config, teacher, key)
    if client_traits(teacher.client).collective:
        _fail(f"{where}: {key}.client={teacher.client} runs the teacher on the student's token ids; a teacher of "
              f"another tokenizer is asked through its own ids: use {key}.client=zmq, openai or cache")
    if config.rl.enabled and config.rl.combination.teacher_in_advantage:
        _fail(f"{where}: rl.combine={config.rl.combine!r} reads the teacher's log-prob of each sampled student token, "
              "which a teacher of another tokenizer has only where the tokens align; use rl.combine=loss or "
              "rl.combine=null")


def _check_full_support(config, teacher, key: str) -> None:
    """``cross_tokenizer.hidden_support=full``: the teacher's whole distribution from its hidden states against the
    student's logit shard through ``W`` (megatron_gkd.losses.cross_vocab.hidden)."""
    where = f"{key}.cross_tokenizer.hidden_support=full"
    if not teacher.signal.sends_hidden:
        _fail(f"{where} compares with the teacher's whole distribution, made in the step from its hidden states: set "
              f"{key}.signal=hidden, or {key}.cross_tokenizer.hidden_support=topk")
    if not config.loss.divergence.cross_tokenizer:
        _fail(f"{where}: loss.type={config.loss.type} has no cross-tokenizer form over the whole vocabulary; use "
              f"{', '.join(cross_tokenizer_divergences())}")
    if config.loss.fused:
        _fail(f"{where} reads the student's logit shard [s, b, V/tp], which loss.fused=true never builds; set "
              f"loss.fused=false, or {key}.cross_tokenizer.hidden_support=topk (its fused form)")


def _check_teacher_mix(config, teachers: dict) -> None:
    """Several teachers: how samples reach them (``teacher_mix``)."""
    mix, names = config.teacher_mix, sorted(teachers)
    if config.teachers and config.teacher.enabled:
        _fail("both teacher.client and teachers are set: give one teacher in `teacher` or several in `teachers`, "
              "not both (set teacher.client=none)")
    if len(teachers) < 2:
        if config.teachers and (mix.weights or mix.routes or mix.default):
            logger.warning("teacher_mix.* has no effect with one teacher")
        return
    unknown = [name for name in [*mix.weights, *mix.routes.values(), *([mix.default] if mix.default else [])]
               if name not in teachers]
    if unknown:
        _fail(f"teacher_mix names teacher(s) {unknown} that teachers does not define (it defines {names})")
    if mix.is_routed:
        if config.data.group_key is None:
            _fail("teacher_mix.mode=route sends each record to the teacher its group names: set data.group_key to the "
                  "dataset field that holds it (e.g. data.group_key=task)")
        if mix.weights:
            logger.warning("teacher_mix.weights has no effect with teacher_mix.mode=route (one teacher per sample)")
    else:
        missing = [name for name in names if name not in mix.weights]
        if missing:
            _fail(f"teacher_mix.mode=mixture weighs every teacher's divergence: teacher_mix.weights lacks {missing} "
                  f"(e.g. teacher_mix.weights.{missing[0]}=0.5)")
        if config.loss.confidence_alpha is not None:
            _fail("loss.confidence_alpha weighs each prompt's samples by one teacher's confidence, which a mixture of "
                  "teachers does not define: use teacher_mix.mode=route or set loss.confidence_alpha=null")
        if mix.routes or mix.default:
            logger.warning("teacher_mix.routes / teacher_mix.default have no effect with teacher_mix.mode=mixture")


def _check_temperature(config, teacher, key: str) -> None:
    """The teacher is ``softmax(logits / teacher.temperature)``, the student ``softmax(logits / loss.temperature)``.

    A teacher that serves T=1 only is refused at any other T; a student at another T than its teacher's is
    warned about: the loss then pulls the student's distribution at one temperature toward the teacher's at
    another, which users of other trainers ran for weeks without noticing (docs/teacher_protocol.md
    "Temperature"). A warning, not an error: a sharper or softer teacher can be meant.
    """
    served = teacher.serve.model is not None  # the run starts the service: its backend decides
    reached = f"serve.backend={teacher.serve.backend}" if served else f"client={teacher.client}"
    any_temperature = (backend_traits(teacher.serve.backend) if served else client_traits(teacher.client)).any_temperature
    if teacher.temperature != 1.0 and not any_temperature:
        backends = " or ".join(name for name in backend_names() if backend_traits(name).any_temperature)
        clients = [name for name in client_names() if client_traits(name).served_option and client_traits(name).any_temperature]
        fix = f"{key}.serve.backend={backends}" if served else f"{key}.client={clients[0]} with {key}.serve.backend={backends}"
        _fail(f"{key}.temperature={teacher.temperature}: a teacher reached with {key}.{reached} "
              f"gives log-probs at temperature 1.0 only; use {fix}, or {key}.temperature=1.0 (with loss.temperature=1.0)")
    if needs_teacher(config) and config.loss.temperature != teacher.temperature:
        logger.warning("loss.temperature=%s (the student's softmax(logits / T)) differs from %s.temperature=%s (the "
                       "teacher's): the student is trained toward the teacher at another temperature; set both to the "
                       "same value unless this is meant", config.loss.temperature, key, teacher.temperature)

"""The config tree: presets load, overrides apply, bad configs fail naming the key and the fix."""

import pathlib
import subprocess
import sys

import pytest

from megatron_gkd.config import check_layout, load_config, to_yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
BASE = ROOT / "configs" / "cpu_tiny.yaml"

# (overrides, world size for the layout check or None, what the message must say)
BAD = [
    (["parallel.tensor_model_paralel_size=2"], None, "did you mean 'parallel.tensor_model_parallel_size'"),
    (["rollout.n=four"], None, "config key 'rollout.n'"),
    (["trainer.schedular=sync"], None, "did you mean 'trainer.scheduler'"),
    (["trainer.scheduler=one_step"], None, "did you mean 'one_step_off'"),
    (["loss.type=tcda"], None, "did you mean 'tcad'"),
    (["loss.options.betta=0.3", "loss.type=jsd"], None, "loss.options: loss_type='jsd' has no option 'betta'; did you mean 'beta'"),
    (["rollout.n=3"], None, "not a multiple of rollout.n=3"),
    (["loss.type=tcad"], None, "set rollout.logprobs_k=K"),
    (["loss.type=tcad", "rollout.logprobs_k=4", "teacher.serve.backend=vllm"], None,
     "teacher.serve.backend=vllm cannot do; use teacher.serve.backend=hf or megatron"),
    (["loss.type=tcad", "trainer.mode=off_policy", "rollout.n=1"], None, "only trainer.mode=on_policy has"),
    (["trainer.mode=off_policy"], None, "set rollout.n=1"),
    (["teacher.client=none", "teacher.serve.model=null"], None, "needs a teacher"),
    (["teacher.address=tcp://127.0.0.1:5555"], None, "not both"),
    (["parallel.pipeline_model_parallel_size=2"], None,
     "weight_sync.transport=colocated needs parallel.pipeline_model_parallel_size=1"),
    (["rollout.layout=disaggregated"], None, "set weight_sync.transport=distributed"),
    (["rollout.max_model_len=64"], None, "raise rollout.max_model_len"),
    (["data.eval_path=null", "eval.interval=5"], None, "give held-out prompts"),
    (["loss.fused=true", "loss.diagnostics=true"], None, "turn one of them off"),
    (["optim.min_lr=1.0"], None, "optim.min_lr=1.0 must lie in [0, optim.lr"),
    (["trainer.mode=distill"], None, "trainer.mode='distill'; choose one of"),
    (["student.checkpoint=null"], None, "student.checkpoint is required"),
    (["rollout.tensor_parallel_size=3"], 2, "rollout.tensor_parallel_size=3 must divide the world size 2"),
    (["rollout.engine=hf"], None, "rollout.tensor_parallel_size=2: rollout.engine=hf holds the whole model on every rank"),
    (["rollout.engine=hf", "rollout.tensor_parallel_size=1", "rollout.layout=disaggregated",
      "weight_sync.transport=distributed"], None, "rollout.engine=hf runs colocated only"),
    (["rollout.release_weights=true"], None,
     "rollout.release_weights=true: rollout.engine=vllm with rollout.layout=colocated cannot release its weights"),
    (["trainer.micro_batch_size=3"], 2, "multiple of dp x micro_batch_size"),
    (["parallel.tensor_model_parallel_size=1", "trainer.global_batch_size=4", "rollout.n=4"], 2,
     "does not split over data-parallel size 2"),
    ([], 3, "world size 3 is not divisible by tensor_model_parallel_size"),
    (["mindspeed.use_flash_atn=true"], None, "did you mean 'mindspeed.use_flash_attn'"),
    (["mindspeed.context_parallel_algo=ring"], None, "mindspeed.context_parallel_algo='ring'; choose one of"),
    (["mindspeed.context_parallel_algo=hybrid_cp_algo"], None, "needs mindspeed.ulysses_degree_in_cp"),
    (["mindspeed.optimization_level=3"], None, "mindspeed.optimization_level=3; choose 0, 1 or 2"),
    (["mindspeed.extra_args=[--use-flash-attn]"], None, "which mindspeed.use_flash_attn owns"),
    (["mindspeed.extra_args=[use-cp-send-recv-overlap]"], None, "mindspeed.extra_args must start with a flag"),
    # rewards with the teacher (rl.*)
    (["rl.combine=los"], None, "rl.combine='los'; did you mean 'loss'"),
    (["rl.combine=loss"], None, "trains on rewards but reward.kind is null"),
    (["rl.combine=advantage", "reward.kind=final_answer", "rollout.n=1"], None, "needs rollout.n >= 2"),
    (["rl.combine=loss", "reward.kind=final_answer", "rl.advantage=grp"], None, "rl.advantage='grp'; did you mean"),
    (["rl.combine=loss", "reward.kind=final_answer", "trainer.mode=off_policy", "rollout.n=1"], None,
     "which only trainer.mode=on_policy has"),
    (["rl.combine=teacher", "rl.kd_coef=0"], None, "trains on nothing"),
    (["rl.combine=teacher", "rl.tis_cap=2", "rollout.temperature=0.7"], None, "set rollout.temperature=1 or rl.tis_cap"),
    (["rl.clip_low=1.0"], None, "rl.clip_low=1.0 must lie in [0, 1)"),
    (["rl.ppo_epochs=0"], None, "rl.ppo_epochs=0 must be >= 1"),
    (["rl.combine=teacher", "rl.teacher_baseline=true", "rollout.temperature=0.7"], None,
     "set rollout.temperature=1 or rl.teacher_baseline=false"),
    (["rl.combine=teacher", "rl.teacher_baseline=true", "rollout.n=1"], None, "set rollout.n >= 2"),
    (["rl.kd_coef_end=0"], None, "rl.kd_coef_end needs rl.kd_coef_steps"),
    (["rl.kd_coef_steps=5"], None, "rl.kd_coef_steps has no effect without rl.kd_coef_end"),
    (["rl.combine=teacher", "rl.kd_coef_end=0", "rl.kd_coef_steps=5"], None, "trains on nothing"),
    (["rl.kl_estimator=k2"], None, "rl.kl_estimator='k2'"),
    # k3 as an advantage follows grad KL(s || t) - grad CE(t, s) (docs/running.md): refused, naming k1
    (["rl.combine=teacher", "rl.kl_estimator=k3"], None, "rl.kl_estimator=k3 with rl.combine='teacher'"),
    (["rl.combine=advantage", "reward.kind=final_answer", "rl.kl_estimator=k3"], None, "set rl.kl_estimator=k1"),
    (["rl.aggregation=token_sum"], None, "rl.aggregation='token_sum'"),
    # DAPO's dynamic sampling: where groups of equal rewards have no advantage, and a batch can be made round by round
    (["rl.combine=teacher", "rl.dynamic_sampling=true"], None,
     "rl.combine='teacher' trains on no reward: use rl.combine=loss or rl.combine=advantage"),
    (["rl.combine=loss", "reward.kind=final_answer", "rl.advantage=reinforce", "rl.dynamic_sampling=true"], None,
     "use rl.advantage=grpo, rloo or dr_grpo, or set rl.dynamic_sampling=false"),
    (["rl.combine=loss", "reward.kind=final_answer", "rollout.n=1", "trainer.global_batch_size=4",
      "rl.dynamic_sampling=true"], None, "so it needs rollout.n >= 2, got rollout.n=1"),
    (["rl.combine=loss", "reward.kind=final_answer", "rl.dynamic_sampling=true", "rollout.layout=disaggregated",
      "weight_sync.transport=distributed"], None, "use rollout.layout=colocated, or set rl.dynamic_sampling=false"),
    (["rl.dynamic_sampling_max_rounds=-1"], None, "rl.dynamic_sampling_max_rounds=-1 must be >= 0"),
]


@pytest.mark.parametrize("overrides, world_size, message", BAD, ids=[case[2][:40] for case in BAD])
def test_bad_config_names_the_key_and_the_fix(overrides, world_size, message):
    from megatron_gkd.trainer.checks import check_registered_names

    with pytest.raises(ValueError) as error:  # every check the entry point runs before it starts anything
        config = load_config(BASE, overrides)
        check_registered_names(config)
        check_layout(config, world_size)
    assert message in str(error.value)


def test_presets_load_and_overrides_win():
    for preset in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(preset)
    config = load_config(BASE, ["rollout.n=8", "loss.type=jsd", "loss.options.beta=0.3", "trainer.global_batch_size=32"])
    assert config.rollout.n == 8 and config.loss.type == "jsd" and config.loss.options == {"beta": 0.3}
    assert config.parallel.tensor_model_parallel_size == 2  # from the preset
    assert check_layout(config, 4)["prompts_per_rank"] == 2


def test_mindspeed_options_become_mindspeed_flags(caplog):
    config = load_config(BASE, ["mindspeed.use_flash_attn=true", "mindspeed.use_fused_rmsnorm=true",
                                "mindspeed.context_parallel_algo=ulysses_cp_algo",
                                "mindspeed.extra_args=[--cp-window-size, '2']"])
    assert config.mindspeed.to_argv() == ["--use-flash-attn", "--use-fused-rmsnorm", "--normalization", "RMSNorm",
                                          "--context-parallel-algo", "ulysses_cp_algo", "--cp-window-size", "2"]
    assert load_config(BASE).mindspeed.to_argv() == []  # the defaults leave MindSpeed at its own
    # Without context parallelism the algorithm is inert, and says so.
    assert "have no effect with parallel.context_parallel_size=1" in caplog.text


def test_resolved_yaml_round_trips(tmp_path):
    config = load_config(BASE, ["rollout.stop_token_ids=[5,7]", "teacher.serve.backend_args={max_top_k: 64}"])
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(config))
    again = load_config(saved)
    assert to_yaml(again) == to_yaml(config)
    assert again.rollout.stop_token_ids == (5, 7) and again.teacher.serve.backend_args == {"max_top_k": 64}


def test_base_presets_compose(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {BASE}\nrollout:\n  n: 2\n")
    config = load_config(child)
    assert config.rollout.n == 2 and config.rollout.max_tokens == 24
    loop = tmp_path / "loop.yaml"
    loop.write_text("base: loop.yaml\n")
    with pytest.raises(ValueError, match="includes itself"):
        load_config(loop)


def test_entry_point_exits_2_with_one_line_and_prints_plans():
    def run(*args):
        return subprocess.run([sys.executable, "launch/pretrain_gkd.py", "--config", str(BASE), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    bad = run("rollout.n=3")
    assert bad.returncode == 2 and bad.stderr.startswith("config error:") and "rollout.n=3" in bad.stderr
    plan = run("--dry-run", "--world-size", "4", "parallel.tensor_model_parallel_size=2", "rollout.tensor_parallel_size=2")
    assert plan.returncode == 0, plan.stderr
    assert "world 4 = tp 2 x pp 1 x dp 2" in plan.stdout and "rank 3: tp 1 dp 1 pp 0" in plan.stdout
    printed = run("--print-config", "rollout.n=8")
    assert printed.returncode == 0 and "'n': 8" in printed.stdout
    # Names in the trainer's registries are checked by the entry point (config/ does not import trainer/); the
    # schedulers' registry is the config's own, checked as the config loads: the same refusal either way.
    for override, key in (("trainer.scheduler=one_stepoff", "trainer.scheduler='one_stepoff'"),
                          ("eval.scorer=exact", "eval.scorer='exact'")):
        bad = run("--print-config", override)
        assert bad.returncode == 2 and bad.stderr.startswith("config error:") and key in bad.stderr, bad.stderr


def test_support_k_is_inert_with_a_union_support_and_says_so(caplog):
    tcad = ["loss.type=tcad", "rollout.logprobs_k=4", "teacher.top_k=4", "loss.support_k=4"]
    load_config(BASE, tcad)
    assert "loss.support_k has no effect" not in caplog.text
    load_config(BASE, [*tcad, "loss.support_mode=union"])
    assert "loss.support_k has no effect with loss.support_mode=union" in caplog.text


def test_the_clip_and_the_teacher_baseline_say_where_they_are_inert(caplog):
    teacher_only = ["rl.combine=teacher", "rl.clip_ratio_c=3"]
    load_config(BASE, [*teacher_only, "rl.ppo_epochs=2"])
    assert "have no effect" not in caplog.text
    load_config(BASE, teacher_only)
    assert "rl.clip_low / rl.clip_high / rl.clip_ratio_c have no effect with one update per batch" in caplog.text
    load_config(BASE, ["rl.mini_batches=2"])
    assert "rl.ppo_epochs / rl.mini_batches have no effect without rl.combine" in caplog.text
    load_config(BASE, ["rl.combine=loss", "reward.kind=final_answer", "rl.teacher_baseline=true"])
    assert "rl.teacher_baseline has no effect with rl.combine=loss" in caplog.text
    load_config(BASE, ["rl.dynamic_sampling=true"])
    assert "rl.dynamic_sampling has no effect without rl.combine" in caplog.text
    load_config(BASE, ["rl.combine=loss", "reward.kind=final_answer", "rl.dynamic_sampling_max_rounds=8"])
    assert "rl.dynamic_sampling_max_rounds has no effect without rl.dynamic_sampling=true" in caplog.text


def test_each_mode_says_what_it_does():
    from megatron_gkd.config.schema import MODES, TrainerConfig

    table = {name: (mode.samples, mode.distills, mode.loss_kind) for name, mode in MODES.items()}
    assert table == {"on_policy": (True, True, "distill"), "off_policy": (False, True, "distill"),
                     "sft": (False, False, "cross_entropy")}
    assert TrainerConfig(mode="off_policy").run_mode is MODES["off_policy"]


def test_a_teacher_of_several_without_a_client_is_named_at_config_time():
    # Once it passed every check and each rank raised "unknown teacher client teacher.client='none'"
    # from inside the trainer's start-up, naming the wrong section.
    with pytest.raises(ValueError, match=r"teachers\.add3\.client is not set .* teachers\.add3\.client=zmq"):
        load_config(ROOT / "configs" / "multi_teacher_cpu.yaml", ["teachers.add3.client=none"])


def test_an_moe_student_with_several_colocated_vllm_replicas_is_refused_on_the_cpu(tmp_path):
    # vLLM's data parallelism with experts fails at the first generate on the CPU (all_gatherv).
    from megatron_gkd.testing.hf_models import make_tiny_checkpoint

    moe = make_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path / "moe")
    replicas = ["rollout.tensor_parallel_size=1", "trainer.global_batch_size=8"]
    config = load_config(BASE, [f"student.checkpoint={moe}", *replicas])
    with pytest.raises(ValueError, match="set rollout.tensor_parallel_size=2 .one engine over all ranks"):
        check_layout(config, 2)
    assert check_layout(load_config(BASE, [f"student.checkpoint={moe}"]), 2)["rollout_replicas"] == 1
    dense = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "dense")
    assert check_layout(load_config(BASE, [f"student.checkpoint={dense}", *replicas]), 2)["rollout_replicas"] == 2


def test_the_hf_engine_gets_no_vllm_options_and_says_the_memory_ones_are_inert(caplog):
    from transformers import PreTrainedTokenizerFast

    from megatron_gkd.trainer.components import rollout_engine_kwargs

    hf = ["rollout.engine=hf", "rollout.tensor_parallel_size=1", "rollout.engine_args={attn_implementation: eager}"]
    with caplog.at_level("WARNING"):
        config = load_config(BASE, hf)  # the preset sizes vLLM's KV cache: rollout.kv_cache_memory_mb=64
    assert "rollout.kv_cache_memory_mb have no effect with rollout.engine=hf" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_config(BASE, [*hf, "rollout.kv_cache_memory_mb=null"])
    assert "no effect" not in caplog.text
    assert check_layout(config, 2)["rollout_replicas"] == 2  # one replica a rank
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=None, tokenizer_object=_tokenizer(), pad_token="b")
    assert rollout_engine_kwargs(config, tokenizer) == dict(
        model=config.student.checkpoint, tensor_parallel_size=1, max_model_len=128, dtype="float32", pad_token_id=1,
        vocab_size=3, release_weights=True, attn_implementation="eager")  # release_weights: on by default
    assert not rollout_engine_kwargs(load_config(BASE, [*hf, "rollout.release_weights=false"]), tokenizer)["release_weights"]
    vllm = rollout_engine_kwargs(load_config(BASE), tokenizer)
    assert vllm["kv_cache_memory_bytes"] == 64 << 20 and vllm["skip_tokenizer_init"] and "release_weights" not in vllm


def _tokenizer():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="a"))


def test_the_advantage_forms_refuse_a_teacher_client_without_token_log_probs():
    from megatron_gkd.teacher.clients import CLIENTS, ClientTraits, register_client

    register_client("no_token_logprobs", "megatron_gkd.teacher.clients.zmq_client:ZmqTeacherClient",
                    ClientTraits("a scorer of top-k rows only", required=(("address", "tcp://HOST:PORT"),),
                                 token_logprobs=False))
    try:
        common = ["teacher.client=no_token_logprobs", "teacher.serve.model=null", "teacher.address=tcp://127.0.0.1:1",
                  "reward.kind=final_answer"]
        with pytest.raises(ValueError, match="teacher.client='no_token_logprobs' does not return: use rl.combine=loss"):
            load_config(BASE, common + ["rl.combine=advantage"])
        load_config(BASE, common + ["rl.combine=loss"])  # the divergence over its rows needs no token log-probs
    finally:
        CLIENTS.unregister("no_token_logprobs")

"""The ``sample_mix`` section (GKD's mixture): the schedules of ``lmbda``, and configs it cannot serve refused at
config time naming the key and the fix."""

import logging
import pathlib

import pytest

from megatron_gkd.config import load_config, needs_responses, needs_rollout, student_samples
from megatron_gkd.config.checks import generating_teacher

ROOT = pathlib.Path(__file__).resolve().parents[3]
BASE = ROOT / "configs" / "cpu_tiny.yaml"
MIX = ["sample_mix.lmbda=0.5"]

BAD = [
    (["sample_mix.lmbda=1.5"], "sample_mix.lmbda=1.5 must be a fraction in [0, 1]"),
    (MIX + ["sample_mix.per=step"], "sample_mix.per='step'; choose 'batch'"),
    (MIX + ["sample_mix.source=student"], "sample_mix.source='student'; choose 'dataset'"),
    (MIX + ["sample_mix.schedule=cosine"], "sample_mix.schedule='cosine'; choose one of"),
    (MIX + ["sample_mix.schedule=linear", "sample_mix.lmbda_end=1.0"], "set both (e.g. sample_mix.lmbda_end=1.0"),
    (MIX + ["sample_mix.schedule=linear", "sample_mix.lmbda_end=2", "sample_mix.ramp_steps=5"],
     "sample_mix.lmbda_end=2"),
    (MIX + ["sample_mix.schedule=step", "sample_mix.milestones=[3]"], "one value per milestone"),
    (MIX + ["sample_mix.schedule=step", "sample_mix.milestones=[5,3]", "sample_mix.values=[0.1,0.2]"],
     "must be increasing steps >= 1"),
    (MIX + ["sample_mix.schedule=step", "sample_mix.milestones=[3]", "sample_mix.values=[-0.1]"],
     "sample_mix.values[0]=-0.1 must be a fraction"),
    (MIX + ["sample_mix.teacher.top_p=0"], "sample_mix.teacher.top_p=0"),
    (MIX + ["trainer.mode=off_policy", "rollout.n=1"], "needs trainer.mode=on_policy (it is off_policy)"),
    (MIX + ["trainer.mode=sft", "rollout.n=1"], "needs trainer.mode=on_policy (it is sft)"),
    (MIX + ["rl.combine=loss", "reward.kind=final_answer"], "set sample_mix.lmbda=null or rl.combine=null"),
    (MIX + ["loss.type=tcad", "rollout.logprobs_k=4"], "use another loss.type (e.g. forward_kl) or sample_mix.lmbda"),
    (MIX + ["sample_mix.source=teacher", "sample_mix.teacher.teacher=big"], "sample_mix.teacher.teacher='big' is not"),
    (MIX + ["sample_mix.source=teacher", "teacher.client=cache", "teacher.cache_dir=/nowhere", "teacher.serve.model=null"],
     "teacher.client='cache' cannot do; use teacher.client=zmq"),
    (MIX + ["sample_mix.source=teacher", "sample_mix.teacher.max_tokens=100", "trainer.max_tokens_per_microbatch=100"],
     "trainer.max_tokens_per_microbatch=100 is smaller than the longest possible sample (164 tokens"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[case[1][:40] for case in BAD])
def test_bad_mixture_names_the_key_and_the_fix(overrides, message):
    with pytest.raises(ValueError) as error:
        load_config(BASE, overrides)
    assert message in str(error.value)


def test_several_teachers_need_the_one_that_writes_named():
    multi = ROOT / "configs" / "multi_teacher_cpu.yaml"
    with pytest.raises(ValueError, match="name the one that writes the responses, e.g. sample_mix.teacher.teacher="):
        load_config(multi, MIX + ["sample_mix.source=teacher"])
    config = load_config(multi, MIX + ["sample_mix.source=teacher", "sample_mix.teacher.teacher=add3"])
    assert generating_teacher(config) == "add3"


def test_default_is_off_and_the_records_need_responses_only_for_the_dataset_source():
    config = load_config(BASE)
    assert not config.sample_mix.enabled and generating_teacher(config) is None and not needs_responses(config)
    assert needs_responses(load_config(BASE, MIX))  # source=dataset (TRL's seq_kd=False) is the default
    teacher = load_config(BASE, MIX + ["sample_mix.source=teacher"])
    assert not needs_responses(teacher) and generating_teacher(teacher) == "teacher"


def test_schedules():
    constant = load_config(BASE, MIX).sample_mix
    assert [constant.lmbda_at(step) for step in (0, 7, 1000)] == [0.5, 0.5, 0.5]
    linear = load_config(BASE, ["sample_mix.lmbda=0", "sample_mix.schedule=linear", "sample_mix.lmbda_end=1",
                                "sample_mix.ramp_start=2", "sample_mix.ramp_steps=4"]).sample_mix
    assert [linear.lmbda_at(step) for step in range(8)] == [0, 0, 0, 0.25, 0.5, 0.75, 1, 1]
    step = load_config(BASE, ["sample_mix.lmbda=0", "sample_mix.schedule=step", "sample_mix.milestones=[3,5]",
                              "sample_mix.values=[0.5,1.0]"]).sample_mix
    assert [step.lmbda_at(s) for s in range(7)] == [0, 0, 0, 0.5, 0.5, 1.0, 1.0]


def test_inert_options_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING):
        load_config(BASE, ["sample_mix.per=prompt"])
    assert "sample_mix.* has no effect while sample_mix.lmbda is null" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_config(BASE, MIX + ["sample_mix.teacher.temperature=0.5", "sample_mix.milestones=[3]"])
    assert "sample_mix.teacher.* (source=teacher only) has no effect" in caplog.text
    assert "sample_mix.milestones / values (schedule=step only) has no effect" in caplog.text


def test_the_generates_trait_says_which_clients_can_ask_for_responses():
    from megatron_gkd.teacher.clients import CLIENTS, TeacherClient, client_names, client_traits

    for name in client_names():
        overrides = CLIENTS.get(name)._generate is not TeacherClient._generate
        traits = client_traits(name)
        # A teacher cache answers generate requests from its files (a cache of teacher-written responses only).
        assert (traits.generates or traits.from_files) == overrides, name


def test_the_dry_run_plan_says_what_the_mixture_draws():
    from megatron_gkd.config.dry_run import layout_plan

    assert "mixture" not in layout_plan(load_config(BASE))
    plan = layout_plan(load_config(BASE, MIX + ["sample_mix.per=prompt", "sample_mix.source=teacher"]))
    assert ("GKD's mixture: lmbda 0.5 (constant) student samples, drawn per prompt; otherwise responses written by "
            "teacher 'teacher' (4 a prompt, temperature 1.0)") in plan


@pytest.mark.parametrize("overrides, num_steps, expected", [
    (["sample_mix.lmbda=0"], 10, True),
    (["sample_mix.lmbda=0.5"], 10, False),
    (["sample_mix.lmbda=0", "sample_mix.schedule=linear", "sample_mix.lmbda_end=0.5", "sample_mix.ramp_steps=4"], 10,
     False),
    (["sample_mix.lmbda=0", "sample_mix.schedule=linear", "sample_mix.lmbda_end=0.5", "sample_mix.ramp_steps=4",
      "sample_mix.ramp_start=10"], 10, True),  # the ramp starts after the run's last step
    (["sample_mix.lmbda=0", "sample_mix.schedule=step", "sample_mix.milestones=[5]", "sample_mix.values=[0.5]"], 5,
     True),
    (["sample_mix.lmbda=0", "sample_mix.schedule=step", "sample_mix.milestones=[5]", "sample_mix.values=[0.5]"], 6,
     False),
    (["sample_mix.lmbda=0", "sample_mix.schedule=step", "sample_mix.milestones=[2, 4]", "sample_mix.values=[0.5, 0]"],
     10, False),  # back to 0 at the end, not in between
    ([], 10, False),  # no mixture: every response is the mode's own
])
def test_never_student_is_lmbda_zero_at_every_step(overrides, num_steps, expected):
    assert load_config(BASE, overrides).sample_mix.never_student(num_steps) is expected


@pytest.mark.parametrize("overrides, samples, rollout", [
    (["sample_mix.lmbda=0", "sample_mix.source=teacher", "eval.at_start=false", "eval.at_end=false"], False, False),
    (["sample_mix.lmbda=0", "sample_mix.source=teacher", "eval.at_start=true"], False, True),  # eval still samples
    (["sample_mix.lmbda=0.5", "sample_mix.source=teacher", "eval.at_start=false", "eval.at_end=false"], True, True),
    (["eval.at_start=false", "eval.at_end=false"], True, True),  # on-policy without a mixture
])
def test_no_rollout_engine_for_a_run_whose_student_never_samples(overrides, samples, rollout):
    config = load_config(BASE, ["trainer.mode=on_policy", "trainer.num_steps=10", "data.eval_path=eval.jsonl", *overrides])
    assert student_samples(config) is samples and needs_rollout(config) is rollout


def test_a_teacher_cache_may_write_the_responses_of_sequence_level_kd_only():
    """teacher.client=cache answers generate requests from a cache of teacher-written responses (check_cache_run
    compares it at start-up): sequence-level KD passes the config's checks, a mixture with the student's own samples
    is refused naming sample_mix.lmbda."""
    cache = ["sample_mix.source=teacher", "teacher.client=cache", "teacher.cache_dir=/nowhere", "teacher.serve.model=null"]
    config = load_config(BASE, ["sample_mix.lmbda=0", *cache])
    assert generating_teacher(config) == "teacher" and not needs_responses(config)
    with pytest.raises(ValueError, match=r"serves sample_mix\.lmbda=0 at every step only"):
        load_config(BASE, ["sample_mix.lmbda=0", "sample_mix.schedule=step", "sample_mix.milestones=[3]",
                           "sample_mix.values=[0.25]", *cache])

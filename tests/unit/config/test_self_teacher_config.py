"""``teacher.client=self`` (issue #50 item 1): what it needs, and what it refuses naming the key and the fix
(pipeline parallelism, the hidden signal, an EMA decay outside (0, 1), a template that reads nothing)."""

import logging
import pathlib

import pytest

from megatron_gkd.config import load_config
from megatron_gkd.teacher.clients import client_traits

BASE = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
SELF = ["teacher.client=self", "teacher.serve.model=null"]
TEMPLATE = 'teacher.privileged_template="Reference solution: {response}\\n\\n{prompt}"'


def test_a_self_teacher_is_a_collective_top_k_client_that_reads_the_student():
    config = load_config(BASE, [*SELF, TEMPLATE])
    assert config.teacher.privileged_template == "Reference solution: {response}\n\n{prompt}"
    assert config.teacher.self_weights is None
    traits = client_traits("self")
    assert traits.collective and traits.reads_student and not traits.generates and traits.signals == ("topk",)
    load_config(BASE, [*SELF, TEMPLATE, "teacher.self_weights=current", "teacher.top_k=512"])
    assert load_config(BASE, [*SELF, TEMPLATE, "teacher.self_weights=initial"]).teacher.self_weights == "initial"
    ema = load_config(BASE, [*SELF, TEMPLATE, "teacher.self_weights=ema"]).teacher
    assert (ema.self_weights, ema.ema_decay) == ("ema", 0.99)
    assert load_config(BASE, [*SELF, TEMPLATE, "teacher.self_weights=ema", "teacher.ema_decay=0.5"]).teacher.ema_decay == 0.5


@pytest.mark.parametrize("overrides, message", [
    ([], "teacher.privileged_template is required for client 'self'"),
    ([TEMPLATE, "parallel.pipeline_model_parallel_size=2"], "set parallel.pipeline_model_parallel_size=1"),
    ([TEMPLATE, "teacher.signal=hidden"], "serves the top-k signal only.*set teacher.signal=topk"),
    ([TEMPLATE, "teacher.self_weights=average"], "must be one of current, initial, ema"),
    ([TEMPLATE, "teacher.self_weights=ema", "teacher.ema_decay=1.0"],
     r"teacher.ema_decay=1.0 must lie in \(0, 1\).*set e.g. teacher.ema_decay=0.99"),
    ([TEMPLATE, "teacher.self_weights=ema", "teacher.ema_decay=0"], r"teacher.ema_decay=0.0 must lie in \(0, 1\)"),
    ([TEMPLATE, "teacher.self_weights=ema", "parallel.pipeline_model_parallel_size=2"],
     "set parallel.pipeline_model_parallel_size=1"),
    (['teacher.privileged_template="no field"'], "teacher.privileged_template='no field' reads no field"),
    (['teacher.privileged_template="{response"'], "teacher.privileged_template=.* is not a format string"),
    ([TEMPLATE, "sample_mix.source=teacher", "sample_mix.lmbda=0.5"], "teacher.client='self' cannot do"),
])
def test_refusals_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(BASE, [*SELF, *overrides])


def test_the_template_is_inert_with_another_client(caplog):
    with caplog.at_level(logging.WARNING):
        load_config(BASE, [TEMPLATE])
    assert "teacher.privileged_template has no effect with client 'zmq' (only 'self' reads it)" in caplog.text


def test_an_ema_decay_without_the_ema_is_inert(caplog):
    with caplog.at_level(logging.WARNING):
        load_config(BASE, [*SELF, TEMPLATE, "teacher.self_weights=initial", "teacher.ema_decay=0.9"])
    assert "teacher.ema_decay has no effect without teacher.self_weights=ema" in caplog.text


def test_the_dry_run_plan_names_the_weights_and_the_template():
    from megatron_gkd.config.dry_run import layout_plan

    plan = layout_plan(load_config(BASE, [*SELF, 'teacher.privileged_template="Hint: {answer} {prompt}"',
                                          "teacher.self_weights=initial"]))
    assert "teacher: self client, the student's initial weights on 'Hint: {answer} {prompt}', top-k 16" in plan
    plan = layout_plan(load_config(BASE, [*SELF, TEMPLATE, "teacher.self_weights=ema", "teacher.ema_decay=0.9"]))
    assert ("teacher: self client, an EMA of the student's weights (decay 0.9, float32, one more copy of the student's "
            "parameters per rank) on") in plan

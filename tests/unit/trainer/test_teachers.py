"""Several teachers: the config names them and says how samples reach them; bad mixes fail naming the key
and the fix; each sample goes to exactly the teacher its group names (route) or to all (mixture)."""

import pathlib

import pytest

from megatron_gkd.config import load_config
from megatron_gkd.trainer.teachers import Teachers

BASE = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
TWO = ["teacher.client=none", "teacher.serve.model=null",
       "teachers.add={client: zmq, top_k: 4, address: 'tcp://127.0.0.1:5601'}",
       "teachers.sub={client: zmq, top_k: 8, address: 'tcp://127.0.0.1:5602'}", "data.group_key=task"]


def _config(*overrides):
    return load_config(BASE, [*TWO, *overrides])


def test_route_sends_each_sample_to_the_teacher_its_group_names():
    teachers = Teachers(_config("teacher_mix.routes={subtraction: sub}", "teacher_mix.default=add"))
    assert teachers.names == ["add", "sub"] and teachers.several and teachers.routed
    plan = teachers.assign(["add", "sub", "subtraction", None, "other", "sub"])
    assert plan == {"add": [0, 3, 4], "sub": [1, 2, 5]}
    assert [t.weight for t in teachers] == [1.0, 1.0]


def test_a_group_without_a_teacher_and_no_default_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"group 'mul' .* teacher_mix.routes.mul=NAME or set teacher_mix.default"):
        Teachers(_config()).assign(["add", "mul"])


def test_mixture_sends_every_sample_to_every_teacher_with_its_weight():
    teachers = Teachers(_config("teacher_mix.mode=mixture", "teacher_mix.weights={add: 0.25, sub: 0.75}"))
    assert teachers.assign(["add", "sub", None]) == {"add": [0, 1, 2], "sub": [0, 1, 2]}
    assert [t.weight for t in teachers] == [0.25, 0.75]


def test_one_teacher_keeps_the_single_teacher_names():
    teachers = Teachers(load_config(BASE, []))
    assert teachers.names == ["teacher"] and not teachers.several and teachers.suffix("teacher") == ""
    assert teachers.assign(["x", None]) == {"teacher": [0, 1]}


@pytest.mark.parametrize("overrides, message", [
    (["teacher.client=zmq", "teacher.address=tcp://127.0.0.1:5600"], "give one teacher in `teacher` or several"),
    (["teacher_mix.mode=mixture", "teacher_mix.weights={add: 1.0}"], "teacher_mix.weights lacks ['sub']"),
    (["teacher_mix.mode=mixture", "teacher_mix.weights={add: 1.0, sub: 1.0}", "loss.confidence_alpha=1.0"],
     "use teacher_mix.mode=route or set loss.confidence_alpha=null"),
    (["data.group_key=null"], "set data.group_key to the dataset field"),
    (["teacher_mix.default=mul"], "names teacher(s) ['mul'] that teachers does not define"),
    (["teacher_mix.mode=blend"], "teacher_mix.mode='blend' must be one of route, mixture"),
    (["teachers.sub.serve.model=/tmp/t", "teachers.sub.address=null", "teachers.sub.serve.backend=vllm",
      "teachers.sub.signal=hidden"], "teachers.sub.signal=hidden needs the teacher's final hidden states"),
])
def test_bad_mixes_fail_naming_the_key_and_the_fix(overrides, message):
    with pytest.raises(ValueError) as caught:
        _config(*overrides)
    assert message in str(caught.value)

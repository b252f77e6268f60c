"""Temperature rules of the config: a teacher serving T=1 only is refused at another T, naming the fix,
and a student at another temperature than its teacher's is warned about (docs/teacher_protocol.md)."""

import logging
import pathlib

import pytest

from megatron_gkd.config import load_config

BASE = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
MISMATCH = "the student is trained toward the teacher at another temperature"


@pytest.mark.parametrize("overrides, message", [
    (["teacher.serve.backend=vllm", "teacher.temperature=2.0"],
     "teacher.temperature=2.0: a teacher reached with teacher.serve.backend=vllm gives log-probs at temperature 1.0 "
     "only; use teacher.serve.backend=hf or megatron, or teacher.temperature=1.0"),
    (["teacher.client=openai", "teacher.serve.model=null", "teacher.base_url=http://127.0.0.1:8000",
      "teacher.temperature=0.5"],
     "teacher.temperature=0.5: a teacher reached with teacher.client=openai gives log-probs at temperature 1.0 "
     "only; use teacher.client=zmq with teacher.serve.backend=hf or megatron"),
])
def test_a_teacher_serving_temperature_one_only_is_refused_at_another(overrides, message):
    with pytest.raises(ValueError) as error:
        load_config(BASE, overrides)
    assert message in str(error.value)


def test_vllm_teacher_at_temperature_one_is_accepted():
    load_config(BASE, ["teacher.serve.backend=vllm", "teacher.temperature=1.0"])


@pytest.mark.parametrize("overrides, warned", [
    (["loss.temperature=2.0"], True),                               # student softened, teacher not
    (["teacher.temperature=0.5"], True),                            # teacher sharpened, student not
    (["loss.temperature=2.0", "teacher.temperature=2.0"], False),   # the same T: the rule
    ([], False),
])
def test_student_and_teacher_temperatures_that_differ_are_warned_about(caplog, overrides, warned):
    with caplog.at_level(logging.WARNING, logger="megatron_gkd.config.checks"):
        load_config(BASE, overrides)
    assert (MISMATCH in caplog.text) == warned
    if warned:
        config = load_config(BASE, overrides)
        assert f"loss.temperature={config.loss.temperature}" in caplog.text
        assert f"teacher.temperature={config.teacher.temperature}" in caplog.text

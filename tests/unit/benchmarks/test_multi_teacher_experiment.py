"""benchmarks/multi_teacher.py: its four methods are the demo's run with the same settings, differing only in
their teachers and training prompts (what the experiment claims is equal is equal)."""

import importlib

import pytest

from megatron_gkd.config import load_config, to_dict
from megatron_gkd.config.checks import check_config
from megatron_gkd.testing import runs as harness

DIFFERENT = ("teacher", "teachers", "teacher_mix")  # sections a method may change (and data.train_path)


@pytest.fixture
def experiment(monkeypatch):
    monkeypatch.syspath_prepend(str(harness.REPO / "benchmarks"))  # a script folder, not a package
    return importlib.import_module("multi_teacher")


def _resolved(experiment, method, tmp_path):
    common = importlib.import_module("distill_quality").common_overrides(tmp_path, 560_000, 1200, 1000)
    config_path, overrides = experiment.overrides(method, 2, tmp_path, common)
    config = load_config(config_path, [*overrides, f"trainer.output_dir={tmp_path / 'run'}"])
    check_config(config)
    return to_dict(config)


def test_methods_share_every_setting_but_teachers_and_prompts(experiment, tmp_path):
    resolved = {method: _resolved(experiment, method, tmp_path) for method in experiment.METHODS}
    shared = {}
    for method, config in resolved.items():
        assert config["data"].pop("train_path") == str(tmp_path / experiment.METHODS[method][1])
        assert config["data"]["eval_path"] == str(tmp_path / "eval.jsonl")  # both tasks, for every method
        assert (config["trainer"]["token_budget"], config["data"]["group_key"]) == (560_000, "task")
        assert (config["trainer"]["seed"], config["rollout"]["seed"], config["data"]["seed"]) == (2, 2, 2)
        shared[method] = {key: value for key, value in config.items() if key not in DIFFERENT}
    reference = shared.pop("routed")
    for method, settings in shared.items():
        differing = sorted(key for key in settings if settings[key] != reference[key])
        assert not differing, (method, differing)


def test_each_method_has_the_teachers_it_names(experiment, tmp_path):
    routed = _resolved(experiment, "routed", tmp_path)
    assert routed["teacher"]["client"] == "none" and routed["teacher_mix"]["mode"] == "route"
    assert {name: (t["serve"]["model"], t["top_k"]) for name, t in routed["teachers"].items()} == {
        "add2": ("assets/demo/teacher", 4), "add3": ("assets/multi_teacher/teacher", 4)}
    assert routed["teacher_mix"]["routes"] == {} and routed["teacher_mix"]["default"] is None  # task name = teacher
    for method, task in (("add2_only", "add2"), ("add3_only", "add3"), ("add2_on_both", "add2")):
        config = _resolved(experiment, method, tmp_path)
        assert config["teachers"] == {}
        assert (config["teacher"]["serve"]["model"], config["teacher"]["top_k"]) == (str(experiment.TEACHERS[task]), 4)

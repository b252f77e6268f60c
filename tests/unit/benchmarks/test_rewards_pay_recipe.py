"""configs/demo_verified_sft.yaml is what benchmarks/rewards_pay.py measured as ``verified_sft_long`` (docs/results.md
"Do rewards pay?"): the demo's config with the form's overrides, from the demo's export, on the verified responses."""

import importlib

from megatron_gkd.config import load_config, to_dict
from megatron_gkd.config.checks import check_config
from megatron_gkd.testing import runs as harness

PATHS = ["student.checkpoint=start", "data.train_path=verified.jsonl", "data.eval_path=eval.jsonl",
         "trainer.output_dir=run"]  # where the benchmark and the recipe keep their files


def test_the_recipe_config_is_the_measured_form(monkeypatch):
    monkeypatch.syspath_prepend(str(harness.REPO / "benchmarks"))  # a script folder, not a package
    bench = importlib.import_module("rewards_pay")
    measured = [*bench.PHASE_2, *(o.format(out="out", n=1) for o in bench.FORMS["verified_sft_long"][1])]
    benchmark = load_config(harness.REPO / "configs" / "demo_cpu.yaml", [*measured, *PATHS])
    recipe = load_config(harness.REPO / "configs" / "demo_verified_sft.yaml", PATHS)
    check_config(recipe)
    assert to_dict(recipe) == to_dict(benchmark)
    # and the recipe is not the demo: the test compares something
    assert to_dict(load_config(harness.REPO / "configs" / "demo_cpu.yaml", PATHS)) != to_dict(recipe)

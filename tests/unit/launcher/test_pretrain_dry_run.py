"""``launch/pretrain_gkd.py --dry-run`` refuses a layout that the student's checkpoint cannot take, before anything
starts, with the message the run itself would give (issue #45: TP=2 for SmolLM2 passed the dry run and failed after
start-up)."""

import pathlib
import subprocess
import sys

from megatron_gkd.testing.hf_models import SMOLLM2_LIKE, make_tiny_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_dry_run_refuses_tp2_for_three_key_value_heads(tmp_path):
    student = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "student", **SMOLLM2_LIKE)
    result = subprocess.run([sys.executable, "launch/pretrain_gkd.py", "--config", "configs/cpu_tiny.yaml", "--dry-run",
                             "--world-size", "2", f"student.checkpoint={student}"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert ("config error: the student (LlamaForCausalLM) has 9 attention heads and 3 key/value heads, which do not "
            "split across parallel.tensor_model_parallel_size=2") in result.stderr
    assert "set parallel.tensor_model_parallel_size to 1 or 3" in result.stderr
    assert result.stdout == ""  # no plan for a run that cannot start

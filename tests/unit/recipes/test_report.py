"""The demo's closing report: the summary's figures come from the run's eval records, and the plot is a PNG."""

import json

from megatron_gkd.recipes import report


def _run_dir(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    records = [{"step": 0, "eval/accuracy": 0.2, "eval/kl_to_teacher": 0.9}]
    records += [{"step": s, "train/loss": 1.0 / s} for s in range(1, 11)]
    records += [{"step": 5, "eval/accuracy": 0.4}, {"step": 10, "eval/accuracy": 0.6, "eval/kl_to_teacher": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "hf" / "step_10").mkdir(parents=True)
    (tmp_path / "hf" / "step_2").mkdir()
    return tmp_path


def test_summary_reports_before_after_teacher_and_the_share_of_the_gap_closed(tmp_path):
    result = report.summary(_run_dir(tmp_path), teacher_accuracy=1.0, wall_time_s=60.0)
    assert (result["accuracy_before"], result["accuracy_after"], result["steps"]) == (0.2, 0.6, 10)
    assert abs(result["gap_closed"] - 0.5) < 1e-12
    assert result["hf_export"].endswith("hf/step_10")
    assert report.summary(tmp_path, teacher_accuracy=None, wall_time_s=None)["gap_closed"] is None


def test_main_writes_a_png_and_reads_the_teachers_accuracy(tmp_path, capfd):
    run_dir = _run_dir(tmp_path / "run")
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "accuracy.json").write_text(json.dumps({"eval/accuracy": 0.9}))
    result = report.main([str(run_dir), "--teacher", str(teacher), "--wall-time", "90"])
    assert result["teacher_accuracy"] == 0.9
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "0.200 -> 0.600" in "".join(capfd.readouterr())


def test_a_run_without_eval_is_reported_without_accuracy_not_a_traceback(tmp_path, capfd):
    run_dir = _run_dir(tmp_path)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if "train/loss" in r))
    result = report.main([str(run_dir), "--teacher", str(tmp_path / "none")])
    assert (result["accuracy_before"], result["accuracy_after"], result["gap_closed"], result["steps"]) == (
        None, None, None, 10)
    assert "no eval ran" in "".join(capfd.readouterr())

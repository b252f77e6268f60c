"""The rank-0 progress output: a bar at a sane rate off a terminal, step lines every N steps, the summary table."""

import io
import json
import logging
import math
import re

from megatron_gkd.config import LoggingConfig
from megatron_gkd.trainer.metrics import MetricsWriter, Progress, summary_table


def _run(progress: Progress, num_steps: int) -> None:
    for step in range(1, num_steps + 1):
        metrics = {"train/loss": 1.0 / step}
        if step == 20:
            metrics["eval/accuracy"] = 0.5
        progress.update(step, metrics, {"rollout": 0.1, "train": 0.2})
    progress.close()


def test_off_a_terminal_the_bar_writes_whole_lines_at_its_interval():
    stream = io.StringIO()  # not a terminal, like a log file or CI
    progress = Progress(40, 0, LoggingConfig(progress_interval_s=3600.0, log_interval=None), stream=stream)
    progress.evaluated({"eval/accuracy": 0.125})  # the eval before the first step
    _run(progress, 40)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert 1 <= len(lines) <= 3, lines  # the start and the end, not one line per step
    assert "40/40" in lines[-1] and "loss 0.0250" in lines[-1] and "eval acc 0.500" in lines[-1], lines[-1]


def test_step_lines_at_info_every_log_interval_steps_and_at_debug_otherwise(caplog):
    config = LoggingConfig(progress_bar=False, log_interval=10)
    with caplog.at_level(logging.INFO, logger="megatron_gkd.trainer.metrics"):
        _run(Progress(25, 0, config), 25)
    assert [r.getMessage().split(" loss")[0] for r in caplog.records] == ["step 10/25", "step 20/25"]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="megatron_gkd.trainer.metrics"):
        _run(Progress(25, 0, config), 25)
    assert len(caplog.records) == 25 and "rollout 0.10s train 0.20s" in caplog.records[0].getMessage()


def test_no_bar_when_disabled():
    stream = io.StringIO()
    _run(Progress(5, 0, LoggingConfig(progress_bar=False), stream=stream), 5)
    assert stream.getvalue() == ""


def test_summary_table_shows_before_and_after_and_where_outputs_are():
    table = summary_table({"steps": 30, "preempted": False, "wall_time_s": 72.4, "final_loss": 0.9037,
                           "output_dir": "/run", "checkpoints": "/run/checkpoints", "hf_export": None,
                           "metrics": "/run/metrics.jsonl", "eval/accuracy_before": 0.002,
                           "eval/accuracy_after": 0.9, "eval/kl_to_teacher_before": 0.938,
                           "peak_rss_gib_per_rank": [1.234, 1.5]})
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in table.splitlines())
    assert rows["steps"] == "30" and rows["wall time"] == "72 s" and rows["final loss"] == "0.9037"
    assert rows["eval/accuracy"] == "0.0020 -> 0.9000"
    assert rows["eval/kl_to_teacher"] == "0.9380 -> n/a"
    assert rows["HF export"] == "none" and rows["checkpoints"] == "/run/checkpoints"
    assert rows["peak RSS per rank"] == "1.23 1.50 GiB"


def _strict(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_metrics_are_written_as_null_with_a_warning_so_the_file_stays_json(tmp_path, caplog):
    writer = MetricsWriter(tmp_path, LoggingConfig(tensorboard=False))
    with caplog.at_level(logging.WARNING, logger="megatron_gkd.trainer.metrics"):
        writer.write(1, {"reward/mean": math.inf, "train/loss": math.nan, "train/lr": 1e-3,
                         "teacher/rows": [1.0, -math.inf], "count": 3})
        writer.write(2, {"reward/mean": -math.inf, "train/loss": 0.5, "eval/kl": math.nan})
        writer.write(3, {"reward/mean": math.nan})
    writer.close()
    records = [_strict(line) for line in writer.path.read_text().splitlines()]
    assert records == [{"step": 1, "reward/mean": None, "train/loss": None, "train/lr": 1e-3,
                        "teacher/rows": [1.0, None], "count": 3},
                       {"step": 2, "reward/mean": None, "train/loss": 0.5, "eval/kl": None},
                       {"step": 3, "reward/mean": None}]
    # Once a key: a diverged run does not log a warning every step.
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "step 1: reward/mean=inf, train/loss=nan, teacher/rows=[1.0, -inf] are not finite; written as null to "
        f"{writer.path} (later steps' non-finite values of these keys too, without a warning)",
        f"step 2: eval/kl=nan are not finite; written as null to {writer.path} (later steps' non-finite values of "
        "these keys too, without a warning)"]

"""A run that loses each of its parts in turn (issue #48 item 4): a trainer rank, the rollout server, a teacher replica
and the teacher service are SIGKILLed, one every 3 steps (:mod:`megatron_gkd.testing.faults`); the run ends, every
step is logged once, and its prompts and losses equal a run without faults to the bit (sync, seeded, deterministic):
nothing trained twice, nothing lost. ``benchmarks/fault_injection.py`` is the long version with the figures."""

import pytest

from megatron_gkd.testing import faults
from megatron_gkd.testing import runs as harness

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

RUN = ["rollout.layout=disaggregated", "weight_sync.transport=distributed", "rollout.tensor_parallel_size=1",
       "trainer.scheduler=sync", "rollout.seed=7", "trainer.deterministic=true", "teacher.serve.num_workers=2",
       "teacher.attempt_timeout_s=10", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=2",
       "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false", "trainer.num_steps=14"]
PARTS = ["trainer_rank", "rollout_server", "teacher_replica", "teacher_service"]


@pytest.mark.slow  # two runs, four kills, a restart of the ranks: about 3 minutes on 2 busy cores
def test_a_run_that_loses_each_part_in_turn_trains_what_a_run_without_faults_trains(assets, tmp_path):
    overrides = harness.asset_overrides(assets) + RUN
    code, log = harness.run(tmp_path / "clean", overrides, log_name="clean.log")
    assert code == 0, log[-4000:]
    clean = harness.steps(tmp_path / "clean")

    process = harness.start(tmp_path / "faulty", overrides, log_name="faulty.log", max_restarts=2)
    injector = faults.FaultInjector(process, tmp_path / "faulty", every=3, parts=PARTS, num_steps=14, cycle=True)
    code = injector.run(timeout_s=900)
    log = process.log_path.read_text(errors="replace")
    assert code == 0, log[-6000:]
    assert [kill.part for kill in injector.kills] == PARTS, log[-6000:]
    assert all(kill.recovered_at is not None for kill in injector.kills)
    assert log.count("resumed at step ") == 1 and "the rollout server died (exit code -9)" in log
    assert "the teacher service" in log and "exited with code -9; starting a new one" in log
    got = harness.steps(tmp_path / "faulty")
    assert [r["step"] for r in got] == list(range(1, 15))
    assert [(r["prompts"], r["train/loss"]) for r in got] == [(r["prompts"], r["train/loss"]) for r in clean]
    assert harness.wait_until(lambda: not harness.leftover_processes(str(assets / "teacher")), 30), \
        "a teacher service outlived the run"

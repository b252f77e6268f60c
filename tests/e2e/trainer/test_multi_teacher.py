"""Two teachers in one run through the real entry point: routed by each record's task, every sample reaches
its teacher and no other (the per-step record of what each teacher scored), with per-teacher metrics; one
of the two teachers killed stops the run after its last complete step, naming that teacher."""

import json
import shutil

import pytest

from megatron_gkd.testing import runs as harness
from tests.e2e.teacher import procs

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

OFF_POLICY = ["trainer.mode=off_policy", "rollout.n=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
              "eval.at_start=false", "eval.at_end=false", "checkpoint.hf_at_end=false", "parallel.tensor_model_parallel_size=1",
              "teacher.client=none", "teacher.serve.model=null", "data.group_key=task", "optim.lr_warmup_steps=0"]


@pytest.fixture(scope="module")
def two_tasks(assets, tmp_path_factory):
    """A second teacher (another random model over the same tokenizer) and train records tagged with a task."""
    from megatron_gkd.recipes.tiny import build_checkpoint

    out = tmp_path_factory.mktemp("two_tasks")
    second = build_checkpoint(out / "teacher_b", hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256,
                              seed=7)
    for name in (assets / "teacher").iterdir():
        if "token" in name.name or name.name.endswith(".jinja"):
            shutil.copy(name, second / name.name)
    tasks = {}
    with open(assets / "train.jsonl") as source, open(out / "train.jsonl", "w") as target:
        for index, line in enumerate(source):
            record = json.loads(line)
            record["task"] = tasks[index] = "a" if index % 3 else "b"
            target.write(json.dumps(record) + "\n")
    return out, tasks


def _teachers(assets, second, b_address=None):
    b = f"teachers.b={{client: zmq, top_k: 8, address: '{b_address}'}}" if b_address else \
        f"teachers.b={{client: zmq, top_k: 8, serve: {{model: '{second}', backend: hf}}}}"
    return [f"teachers.a={{client: zmq, top_k: 4, serve: {{model: '{assets / 'teacher'}', backend: hf}}}}", b]


def test_routing_sends_every_sample_to_its_teacher_and_logs_each_teacher(assets, two_tasks, tmp_path):
    out_dir, tasks = two_tasks
    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + OFF_POLICY + _teachers(assets, out_dir / "teacher_b") + [
        f"data.train_path={out_dir / 'train.jsonl'}", "trainer.num_steps=3", "checkpoint.save_interval=null"], nproc=1)
    assert code == 0, log[-4000:]
    steps = harness.steps(out)
    assert len(steps) == 3
    for record in steps:
        by_task = {name: sorted(p for p in record["prompts"] if tasks[p] == name) for name in ("a", "b")}
        assert record["teacher/a/prompts"] == by_task["a"] and record["teacher/b/prompts"] == by_task["b"]
        assert record["train/loss"] == pytest.approx(record.get("train/loss/a", 0) + record.get("train/loss/b", 0))
        for name in ("a", "b"):
            scored = record[f"teacher/{name}/tokens_scored"]
            assert (scored > 0) == bool(by_task[name]) and record[f"teacher/{name}/retries"] == 0
            if by_task[name]:
                assert record[f"teacher/{name}/latency_s"] > 0 and 0 < record[f"train/teacher_mass/{name}"] <= 1
                assert record[f"train/num_loss_tokens/{name}"] == scored


@pytest.mark.slow  # suite time; tests/e2e/trainer/test_teacher_faults.py stops on a dead teacher in the default tier
def test_one_of_two_teachers_killed_stops_the_run_naming_it(assets, two_tasks, tmp_path):
    out_dir, _ = two_tasks
    with procs.proxy_and_workers(tmp_path) as (proxy, start_worker):
        worker, _ = start_worker("b", out_dir / "teacher_b")
        out = tmp_path / "run"
        run = harness.start(out, harness.asset_overrides(assets) + OFF_POLICY + _teachers(
            assets, None, proxy.frontend_address) + [
            f"data.train_path={out_dir / 'train.jsonl'}", "trainer.num_steps=50", "checkpoint.save_interval=1",
            "teachers.b.attempt_timeout_s=3", "teachers.b.deadline_s=8", "teachers.b.max_attempts=2"], nproc=1)
        harness.wait_for_steps(out, 2, run)
        procs.stop(worker, kill=True)
        code = harness.wait(run, 600)
    log = run.log_path.read_text()
    assert code != 0 and "teacher 'b' failed" in log and "[unavailable]" in log, log[-3000:]
    trained = [r["step"] for r in harness.steps(out)]
    assert trained == list(range(1, len(trained) + 1)) and 2 <= len(trained) < 50
    assert (out / "checkpoints" / "latest").read_text().strip() == f"iter_{trained[-1]:07d}"


@pytest.mark.slow  # a vLLM rollout: the policy-gradient path runs in the default tier in test_rl_with_teacher.py
def test_routed_teachers_with_a_verifier_per_task_train_the_policy_gradient(assets, two_tasks, tmp_path):
    # Each task's teacher scores its samples and each task's verifier rewards them; the teacher's log-prob of each
    # sampled token reaches the advantage from the teacher that scored the sample.
    out_dir, tasks = two_tasks
    out = tmp_path / "run"
    code, log = harness.run(out, harness.asset_overrides(assets) + _teachers(assets, out_dir / "teacher_b") + [
        "teacher.client=none", "teacher.serve.model=null", "data.group_key=task", f"data.train_path={out_dir / 'train.jsonl'}",
        "parallel.tensor_model_parallel_size=1", "rollout.tensor_parallel_size=1", "trainer.scheduler=sync",
        "trainer.num_steps=2", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=null",
        "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false", "reward.kind=function",
        "reward.function=tests.e2e.trainer.reward_functions:per_task", "rl.combine=advantage"], nproc=1)
    assert code == 0, log[-4000:]
    steps = harness.steps(out)
    assert len(steps) == 2
    for record in steps:
        assert record["teacher/a/tokens_scored"] + record["teacher/b/tokens_scored"] == record["rollout/num_tokens"]
        assert record["reward/count"] == 16.0 and record["pg/teacher_kl"] != 0.0
        assert record["train/kd_loss"] == 0.0 and record["train/loss"] == pytest.approx(record["pg/loss"], rel=1e-6)

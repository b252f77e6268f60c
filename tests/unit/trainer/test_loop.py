"""``Trainer(config).train()`` in this process (#31 item 2: the Trainer had no direct test): a gloo world of one, SFT on
the dataset's responses of a tiny random student, so no torchrun, no teacher service and no rollout engine. A run trains
its steps and leaves its summary, metrics (metrics.jsonl and TensorBoard) and checkpoint; a preemption signal makes it
checkpoint after the step it is in and stop; the same config run again resumes at the saved step and goes on from there.
``Trainer.close()`` destroys Megatron's model-parallel state, so one process builds one trainer after another. One
on-policy run (the ``megatron`` rollout engine, a colocated teacher) checks ``rl.dynamic_sampling``'s resume."""

import math
import os
import shutil
import signal

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_gkd import parallel
from megatron_gkd.config import load_config
from megatron_gkd.recipes.tiny import build_checkpoint, build_tokenizer, write_prompts
from megatron_gkd.testing import runs
from megatron_gkd.trainer import run_dir
from megatron_gkd.trainer.checkpoint_dirs import find_checkpoint
from megatron_gkd.trainer.loop import Trainer
from megatron_gkd.trainer.teacher_exchange import TeacherFailed

pytestmark = pytest.mark.usefixtures("gloo_world")  # conftest.py: a gloo world of one process (and signal_handlers)
VOCAB = 64


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A one-layer random Qwen3 student (64 wide, a 64-word tokenizer) and 16 prompts with reference responses."""
    out = tmp_path_factory.mktemp("assets")
    build_checkpoint(out / "student", vocab_size=VOCAB, hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1,
                     intermediate_size=64, seed=2)
    build_tokenizer(out / "student", VOCAB)
    write_prompts(out / "train.jsonl", 16, vocab_size=VOCAB, seed=3)
    return out


def sft_overrides(assets, out, num_steps: int) -> list[str]:
    return [f"student.checkpoint={assets / 'student'}", f"data.train_path={assets / 'train.jsonl'}",
            f"trainer.output_dir={out}", "trainer.mode=sft", "rollout.n=1", f"trainer.num_steps={num_steps}",
            "trainer.global_batch_size=2", "trainer.micro_batch_size=1", "data.max_prompt_length=32",
            "logging.progress_bar=false", "checkpoint.hf_at_end=false", "optim.lr=1e-3"]


def sft_config(assets, out, num_steps: int):
    return load_config(None, sft_overrides(assets, out, num_steps))


def trained_steps(out) -> list[int]:
    return [record["step"] for record in runs.steps(out)]


def train_once(config, preempt: bool = False, read=None):
    """Trains a run of ``config`` (``preempt``: as if signalled during the first step: it checkpoints after it and
    stops); returns ``read(trainer)`` taken before the trainer is closed."""
    trainer = Trainer(config)
    try:
        if preempt:
            os.kill(os.getpid(), signal.SIGUSR1)
        trainer.train()
        return read(trainer) if read is not None else None
    finally:
        trainer.close()


def test_a_run_trains_its_steps_and_leaves_metrics_and_a_checkpoint(assets, tmp_path, signal_handlers):
    out = tmp_path / "run"
    trainer = Trainer(sft_config(assets, out, num_steps=2))
    try:
        assert trainer.step == 0  # nothing to resume
        summary = trainer.train()
    finally:
        trainer.close()
    with pytest.raises(RuntimeError, match="not initialised"):  # close() destroyed the model-parallel state
        parallel.get_state()
    assert summary["steps"] == 2 and not summary["preempted"] and math.isfinite(summary["final_loss"])
    records = runs.steps(out)
    assert [record["step"] for record in records] == [1, 2]
    assert all(math.isfinite(record["train/loss"]) for record in records)
    assert summary["final_loss"] == records[-1]["train/loss"]
    assert run_dir.config_file(out).is_file()
    events = EventAccumulator(str(run_dir.tensorboard_dir(out))).Reload()  # what TensorBoard shows
    shown = [(event.step, event.value) for event in events.Scalars("train/loss")]
    assert shown == [(record["step"], pytest.approx(record["train/loss"])) for record in records]
    assert find_checkpoint(run_dir.checkpoints(out)).step == 2  # checkpoint.save_at_end


def test_a_preempted_run_checkpoints_and_the_same_config_resumes_at_its_step(assets, tmp_path, signal_handlers):
    out = tmp_path / "run"
    config = sft_config(assets, out, num_steps=3)
    trainer = Trainer(config)
    try:
        # Slurm's warning before the job's time is up, as if it came during the first step: the run finishes that
        # step, checkpoints and stops.
        os.kill(os.getpid(), signal.SIGUSR1)
        preempted = trainer.train()
    finally:
        trainer.close()
    assert preempted["preempted"] and preempted["steps"] == 1 and math.isfinite(preempted["final_loss"])
    assert find_checkpoint(run_dir.checkpoints(out)).step == 1
    assert trained_steps(out) == [1]

    trainer = Trainer(config)  # the same command again
    try:
        assert trainer.step == 1
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary["steps"] == 3 and not summary["preempted"]
    assert trained_steps(out) == [1, 2, 3]  # it went on from the saved step: none trained twice, none skipped
    assert find_checkpoint(run_dir.checkpoints(out)).step == 3


def test_the_start_makes_the_dry_runs_checkpoint_checks_first(assets, tmp_path):
    # config/checkpoints.py, the function --dry-run calls: here a tokenizer with ids past the student's table, refused
    # before the data and the model are loaded.
    student = tmp_path / "student"
    shutil.copytree(assets / "student", student)
    build_tokenizer(student, VOCAB + 16)
    with pytest.raises(ValueError, match=f"has {VOCAB + 16} ids but Qwen3ForCausalLM's table has {VOCAB} rows"):
        Trainer(load_config(None, [*sft_overrides(assets, tmp_path / "run", 1), f"student.checkpoint={student}"]))


def test_a_batch_whose_teacher_failed_is_the_first_trained_after_the_resume(assets, tmp_path, signal_handlers):
    """Issue #48 item 1, for a teacher's failure (the save-after-failure path that a reward's failure shares): the
    checkpoint records the failed batch's data position, so the same command trains that batch first, not the next."""
    out = tmp_path / "run"
    config = load_config(None, [*sft_overrides(assets, out, num_steps=3), "checkpoint.save_interval=1"])
    seen: list[list[int]] = []

    def run(fail_at: int | None) -> None:
        trainer = Trainer(config)
        update = trainer._update

        def recorded(batch):
            seen.append(list(batch.prompt_indices))
            if len(seen) == fail_at:
                raise TeacherFailed("teacher", TimeoutError("no answer within its deadline"))
            return update(batch)

        trainer._update = recorded
        try:
            trainer.train()
        finally:
            trainer.close()

    with pytest.raises(TeacherFailed, match="no answer within its deadline"):
        run(fail_at=2)
    assert find_checkpoint(run_dir.checkpoints(out)).step == 1 and trained_steps(out) == [1]
    failed = seen[1]
    run(fail_at=None)  # the same command again
    assert seen[2] == failed, "the resumed run skipped the batch whose teacher failed"
    assert trained_steps(out) == [1, 2, 3]


def test_dynamic_sampling_resumes_at_the_prompts_an_uninterrupted_run_trains(assets, tmp_path, signal_handlers,
                                                                             one_thread):
    """``rl.dynamic_sampling`` in the trainer (a colocated teacher, the ``megatron`` rollout engine, a regex reward):
    batches that drop groups of equal rewards draw more prompts, and a run preempted after its first step resumes at
    the prompts the uninterrupted run trains next, whatever the extra rounds drew."""
    def overrides(out):
        return [*sft_overrides(assets, out, num_steps=4), "trainer.mode=on_policy", f"teacher.checkpoint={assets / 'student'}",
                "teacher.client=local", "teacher.serve.model=null", "teacher.top_k=4", "rollout.engine=megatron",
                "rollout.n=4", "rollout.max_tokens=4", "rollout.seed=3", "trainer.global_batch_size=8",
                "trainer.micro_batch_size=8", "reward.kind=regex", r"reward.pattern='\bw[0-2]\b'", "rl.combine=loss",
                "rl.dynamic_sampling=true", "checkpoint.save_interval=1", "logging.tensorboard=false"]

    def run(out, preempt: bool = False) -> None:
        train_once(load_config(None, overrides(out)), preempt)

    run(tmp_path / "whole")
    whole = runs.steps(tmp_path / "whole")
    assert whole[0]["rl/dynamic_rounds"] > 1  # the first batch refilled: the resume starts past its extra draws
    assert all(record["rl/dynamic_groups_short"] == 0 for record in whole)
    run(tmp_path / "resumed", preempt=True)
    assert trained_steps(tmp_path / "resumed") == [1]
    run(tmp_path / "resumed")  # the same command again
    resumed = runs.steps(tmp_path / "resumed")
    same = ("prompts", "reward/mean", "train/loss", *(key for key in whole[0] if key.startswith("rl/dynamic")))
    assert [[record[key] for key in same] for record in resumed] == [[record[key] for key in same] for record in whole]


def test_a_self_teachers_ema_resumes_as_the_uninterrupted_run_has_it(assets, tmp_path, signal_handlers):
    """``teacher.self_weights=ema`` (off-policy self-distillation on the records' responses): the EMA is in the
    checkpoint, so a run preempted after its first step resumes with the uninterrupted run's EMA: the same teacher rows,
    hence the same losses, and the same EMA at the end (an EMA restarted from the initial weights differs from step 2)."""
    def overrides(out):
        return [*sft_overrides(assets, out, num_steps=3), "trainer.mode=off_policy", "teacher.client=self",
                "teacher.serve.model=null", 'teacher.privileged_template="{response} {prompt}"', "teacher.top_k=8",
                "teacher.self_weights=ema", "teacher.ema_decay=0.5", "checkpoint.save_interval=1",
                "logging.tensorboard=false", "optim.lr=3e-2", "optim.lr_warmup_steps=0"]

    def averaged(trainer) -> list:
        (ema,) = trainer.teachers.averages
        return [p.detach().clone() for chunk in ema.chunks for p in chunk.parameters()]

    def run(out, preempt: bool = False) -> list:
        return train_once(load_config(None, overrides(out)), preempt, averaged)

    whole = run(tmp_path / "whole")
    run(tmp_path / "resumed", preempt=True)
    assert trained_steps(tmp_path / "resumed") == [1]
    resumed = run(tmp_path / "resumed")  # the same command again
    losses = [[record["train/loss"] for record in runs.steps(tmp_path / name)] for name in ("whole", "resumed")]
    assert len(losses[0]) == 3 and losses[0] == losses[1], losses
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))


def test_a_checkpoint_without_the_ema_is_refused_by_a_run_that_reads_one(assets, tmp_path, signal_handlers):
    """Turning ``teacher.self_weights=ema`` on at a resume: the checkpoint has no EMA to restore; the run stops naming it
    rather than restart the average from the initial weights."""
    out = tmp_path / "run"
    common = [*sft_overrides(assets, out, num_steps=2), "trainer.mode=off_policy", "teacher.client=self",
              "teacher.serve.model=null", 'teacher.privileged_template="{response} {prompt}"', "teacher.top_k=8",
              "logging.tensorboard=false"]
    train_once(load_config(None, common), preempt=True)
    with pytest.raises(ValueError, match=r"holds no teacher.ema .*teacher.self_weights=ema"):
        train_once(load_config(None, [*common, "teacher.self_weights=ema"]))

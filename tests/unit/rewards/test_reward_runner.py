"""Rewards computed in the worker process: results off the caller's thread, and every way a reward fails
ending in one RewardFailed that names the reward and the record (never a partial or padded result)."""

import math
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_gkd.rewards import RewardBatch, RewardConfig, RewardFailed, RewardRunner
from megatron_gkd.rewards import runner as runner_module
from megatron_gkd.rewards.runner import check_values

FUNCTIONS = "tests.unit.rewards.reward_functions"
ROOT = pathlib.Path(__file__).resolve().parents[3]


def batch(responses=("ok", "ok", "bad", "ok"), answers=None) -> RewardBatch:
    answers = answers or ["432"] * len(responses)
    return RewardBatch(prompts=[f"{i} 7 + 3 8 5 =" for i in range(len(responses))], responses=list(responses),
                       records=[{"index": 100 + i, "answer": answer} for i, answer in enumerate(answers)])


@pytest.fixture
def start():
    runners = []

    def build(function: str | None = None, **settings) -> RewardRunner:
        if function is not None:
            settings.update(kind="function", function=f"{FUNCTIONS}:{function}")
        runners.append(RewardRunner(RewardConfig(**settings)))
        return runners[-1]

    yield build
    for runner in runners:
        runner.close()


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited (nobody reaped it yet)


def _gone(pids, within_s: float = 5.0) -> bool:
    pids = list(pids)
    deadline = time.monotonic() + within_s
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_demo_verifier_through_the_worker(start):
    runner = start(kind="final_answer")
    runner.wait_ready(timeout=30)
    output = runner.compute(batch(["2 3 4 #### 4 3 2", "#### 4 3 3", "4 3 2", "####4 3\n2"]))
    assert output.values == [1.0, 0.0, 0.0, 1.0]
    assert 0 <= output.seconds <= output.wall_s
    assert runner.compute(RewardBatch([], [], [])).values == []


def test_submit_returns_at_once_and_calls_are_served_in_order(start):
    runner = start("length_bonus")
    runner.wait_ready(timeout=30)
    began = time.perf_counter()
    futures = [runner.submit(batch([f"#### {i}"], answers=[str(i)])) for i in range(5)]
    assert time.perf_counter() - began < 0.05
    assert [f.result(timeout=30).values for f in futures] == [[1.6]] * 5


def test_numpy_results_and_prints_on_stdout_do_not_disturb_the_replies(start):
    assert start("as_numpy").compute(batch()).values == [0.0, 1.0, 2.0, 3.0]
    assert start("prints").compute(batch()).values == [1.0] * 4


@pytest.mark.parametrize("function, responses, words, record", [
    ("raises_on_bad", ("ok", "ok", "bad", "ok"),
     "raised ZeroDivisionError: division by zero on record 2 of 4 (id 102, prompt '2 7 + 3 8 5 =')", 2),
    ("raises_always", ("ok",) * 4, "raised RuntimeError: the grader service is down on record 0 of 4 (id 100", 0),
    ("nan_on_second", ("ok",) * 4, "returned nan for record 1 of 4 (id 101, prompt '1 7 + 3 8 5 ='); rewards must "
                                   "be finite", 1),
    ("inf_values", ("ok",) * 4, "returned inf for record 0 of 4 (id 100", 0),
    ("absurd_on_second", ("ok",) * 4, "returned 1e+308 for record 1 of 4 (id 101, prompt '1 7 + 3 8 5 ='); rewards "
                                      "must be within +-reward.max_abs=1000000.0", 1),
    ("one_short", ("ok",) * 4, "returned 3 values for a batch of 4 records (ids 100, 101, 102, 103; first prompt "
                               "'0 7 + 3 8 5 ='); it must return one per response", None),
    ("strings", ("ok",) * 4, "returned a str ('1.0') for record 0 of 4 (id 100", 0),
    ("none_on_third", ("ok",) * 4, "returned a NoneType (None) for record 2 of 4 (id 102", 2),
    ("a_float", ("ok",) * 4, "returned a float (1.0) for a batch of 4 records (ids 100, 101, 102, 103; first prompt "
                             "'0 7 + 3 8 5 ='); it must return a sequence of 4 floats, one per response", None),
    ("a_generator", ("ok",) * 4, "returned a generator (<generator object", None),
    ("dies", ("ok",) * 4, "failed: its worker exited (code 3) during a batch of 4 records (ids 100", None),
])
def test_every_failure_is_a_reward_failed_naming_the_function_and_the_record(start, function, responses, words,
                                                                             record):
    runner = start(function)
    with pytest.raises(RewardFailed) as caught:
        runner.compute(batch(responses))
    assert str(caught.value).startswith(f"reward '{FUNCTIONS}:{function}' ")
    assert words in str(caught.value)
    assert (caught.value.reward, caught.value.record) == (f"{FUNCTIONS}:{function}", record)


def test_a_hang_past_the_timeout_kills_the_worker_and_its_children(start, tmp_path, monkeypatch):
    pid_file = tmp_path / "pids"
    monkeypatch.setenv("REWARD_TEST_PID_FILE", str(pid_file))
    runner = start("hangs_in_a_child", timeout_s=1.0)
    runner.wait_ready(timeout=30)
    began = time.perf_counter()
    with pytest.raises(RewardFailed) as caught:
        runner.compute(batch())
    assert time.perf_counter() - began < 5.0
    assert str(caught.value) == (f"reward '{FUNCTIONS}:hangs_in_a_child' gave no rewards within reward.timeout_s=1.0 s "
                                 "for a batch of 4 records (ids 100, 101, 102, 103; first prompt '0 7 + 3 8 5 ='); its "
                                 "worker was killed")
    worker, child = map(int, pid_file.read_text().split())
    assert _gone([worker, child])


def test_processes_in_sessions_of_their_own_die_with_the_worker(start, tmp_path, monkeypatch):
    """Issue #48: the runner killed only the worker's process group; a grader's process that left it (a session of
    its own) outlived the call's timeout, the runner's close and the trainer."""
    pid_file = tmp_path / "pids"
    monkeypatch.setenv("REWARD_TEST_PID_FILE", str(pid_file))
    runner = start("hangs_beside_its_own_session", timeout_s=1.0)
    with pytest.raises(RewardFailed, match="gave no rewards within reward.timeout_s=1.0 s"):
        runner.compute(batch())
    assert _gone(map(int, pid_file.read_text().split())), "the timeout's kill left a process behind"

    pid_file.unlink()
    runner = start("leaves_its_own_session")
    assert runner.compute(batch()).values == [1.0] * 4
    worker, grandchild = map(int, pid_file.read_text().split())
    assert _alive(grandchild)  # kept between calls: a grader may hold a server
    runner.close()
    assert _gone([worker, grandchild]), "closing the runner left a process behind"


def test_processes_in_sessions_of_their_own_die_with_a_killed_trainer(tmp_path):
    pid_file = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import os, time
        from megatron_gkd.rewards import RewardBatch, RewardConfig, RewardRunner
        runner = RewardRunner(RewardConfig(kind="function", function="{FUNCTIONS}:hangs_beside_its_own_session",
                                           timeout_s=600))
        future = runner.submit(RewardBatch(["p"], ["r"], [{{}}]))
        time.sleep(3600)
    """)
    env = {**os.environ, "REWARD_TEST_PID_FILE": str(pid_file), "PYTHONPATH": str(ROOT)}
    trainer = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and trainer.poll() is None
            time.sleep(0.05)
    finally:
        trainer.kill()
        trainer.wait()
    assert _gone(map(int, pid_file.read_text().split())), "a killed trainer's reward left a process behind"


def test_after_a_failure_the_next_call_gets_a_fresh_worker(start):
    runner = start(kind="final_answer", format_pattern="####", timeout_s=30)
    with pytest.raises(RewardFailed, match=r"cannot score record 1 of 2 \(id 101, prompt '1 7 \+ 3 8 5 ='\): it has "
                                           r"no 'answer' \(set data.answer_key"):
        runner.compute(batch(["#### 4 3 2", "#### 4 3 2"], answers=["432", None]))
    assert runner.compute(batch(["#### 4 3 2", "4 3 2"])).values == [1.1, 0.0]
    dying = start("dies")
    for _ in range(2):  # each call starts a worker again after the last one died
        with pytest.raises(RewardFailed, match="its worker exited"):
            dying.compute(batch())


def test_a_function_that_does_not_import_fails_at_start_up_naming_it(start):
    runner = start("missing_function")
    with pytest.raises(RewardFailed) as caught:
        runner.wait_ready(timeout=30)
    assert str(caught.value) == (f"reward '{FUNCTIONS}:missing_function' could not start: ValueError: reward.function="
                                 f"'{FUNCTIONS}:missing_function': '{FUNCTIONS}' has no attribute 'missing_function'")
    with pytest.raises(RewardFailed, match="could not start"):
        runner.compute(batch())


def test_close_stops_a_hung_call_and_cancels_the_queued_ones(start):
    runner = start("hangs", timeout_s=600)
    runner.wait_ready(timeout=30)
    running, queued = runner.submit(batch()), runner.submit(batch())
    time.sleep(0.2)
    began = time.perf_counter()
    runner.close()
    assert time.perf_counter() - began < 5.0
    with pytest.raises(RewardFailed, match="was stopped: the runner was closed"):
        running.result(timeout=5)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="the reward runner is closed"):
        runner.submit(batch())


def test_a_hung_reward_does_not_hang_the_process_at_exit(tmp_path):
    """The trainer exits (a failure elsewhere, the end of the run) while a reward hangs, without closing."""
    pid_file = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import os, time
        from megatron_gkd.rewards import RewardBatch, RewardConfig, RewardRunner
        runner = RewardRunner(RewardConfig(kind="function", function="{FUNCTIONS}:hangs_in_a_child", timeout_s=600))
        future = runner.submit(RewardBatch(["p"], ["r"], [{{}}]))
        while not os.path.exists({str(pid_file)!r}) or not open({str(pid_file)!r}).read():
            time.sleep(0.02)
    """)
    env = {**os.environ, "REWARD_TEST_PID_FILE": str(pid_file), "PYTHONPATH": str(ROOT)}
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, timeout=60, check=True)
    assert time.perf_counter() - began < 30
    assert _gone(map(int, pid_file.read_text().split()))


def test_check_values_accepts_finite_numbers_within_the_bound_only():
    four = batch(("ok",) * 4)
    assert check_values("r", ("sequence", [0.0, 1.0, -2.5, 1e6]), four) == [0.0, 1.0, -2.5, 1e6]
    assert check_values("r", ("sequence", [0.0, 1.0, -2.5, 1e300]), four, max_abs=1e300) == [0.0, 1.0, -2.5, 1e300]
    for reply, words in [(("sequence", [0.0, 1.0, 2.0, -math.inf]), "returned -inf for record 3 of 4"),
                         (("sequence", [0.0, 1.0, -1e300, 0.0]), "returned -1e+300 for record 2 of 4"),
                         (("sequence", [0.0, 1.0, 2.0, 1000000.5]), "returned 1000000.5 for record 3 of 4"),
                         (("sequence", [0.0, ("list", "[1.0]"), 0.0, 0.0]), "returned a list ([1.0]) for record 1"),
                         (("sequence", [0.0] * 5), "returned 5 values for a batch of 4 records"),
                         (("not a sequence", "dict", "{}"), "returned a dict ({}) for a batch of 4 records")]:
        with pytest.raises(RewardFailed, match="^reward 'r' ") as caught:
            check_values("r", reply, four)
        assert words in str(caught.value)


def test_batches_hold_one_prompt_and_record_per_response():
    with pytest.raises(ValueError, match="2 prompts, 1 responses and 2 records"):
        RewardBatch(["a", "b"], ["x"], [{}, {}])
    long = RewardBatch(["question: " + "x" * 100 + " what is 2+2?"], ["4"], [{"id": "q-7"}])
    assert long.describe(0) == "record 0 of 1 (id 'q-7', prompt '..." + "x" * 47 + " what is 2+2?')"


def test_a_reply_that_cannot_be_read_fails_the_call_at_once(start, monkeypatch):
    monkeypatch.setattr(runner_module, "WORKER_MODULE", "tests.unit.rewards.garbage_worker")
    runner = start(kind="final_answer", timeout_s=600)
    began = time.perf_counter()
    with pytest.raises(RewardFailed, match=r"sent a reply that cannot be read \(ValueError: a frame of \d+ bytes "
                                           r"announced, at most 268435456 expected\) for a batch of 4 records"):
        runner.compute(batch())
    assert time.perf_counter() - began < 10  # not after reward.timeout_s


def test_a_kind_registered_in_the_trainer_alone_is_found_by_the_worker(start, monkeypatch):
    from megatron_gkd.rewards import REWARDS

    monkeypatch.setattr(REWARDS, "_entries", {**REWARDS._entries, "plugin": f"{FUNCTIONS}:PluginKind"})
    assert start(kind="plugin").compute(batch(["a", "bb", "", "dddd"])).values == [1.0, 2.0, 0.0, 4.0]


def test_a_catastrophic_regular_expression_is_stopped_by_the_timeout(start):
    """A backtracking ``re`` cannot be interrupted from Python: in a thread it would run until the process exits."""
    runner = start(kind="regex", pattern=r"^(a+)+$", timeout_s=1.0)
    runner.wait_ready(timeout=30)
    with pytest.raises(RewardFailed, match=r"^reward 'regex' gave no rewards within reward.timeout_s=1.0 s"):
        runner.compute(batch(["a" * 40 + "b"]))
    assert runner.compute(batch(["aaa"])).values == [1.0]

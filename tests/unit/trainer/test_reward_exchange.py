"""The reward exchange with a fake runner (one process, no torch.distributed): a batch's samples go to the
runner as text with their records, the rewards come back under the ``reward_wait`` timer, a failure raises
the runner's RewardFailed, and a run without rewards adds nothing."""

import concurrent.futures
import types
import unittest.mock

import pytest
import torch

from megatron_gkd.rewards import RewardFailed, RewardOutput
from megatron_gkd.trainer.batch import Sample
from megatron_gkd.trainer.metrics import Timers
from megatron_gkd.trainer.reward_exchange import RewardExchange

EOS = 9


class Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        assert skip_special_tokens
        return " ".join(map(str, ids))


class Runner:
    """Answers each batch with ``values`` (or raises ``error``) and keeps what it was sent."""

    def __init__(self, values=None, error=None, ready_error=None):
        self.values, self.error, self.ready_error, self.sent = values, error, ready_error, []

    def wait_ready(self):
        if self.ready_error is not None:
            raise self.ready_error

    def submit(self, batch):
        self.sent.append(batch)
        future = concurrent.futures.Future()
        if self.error is not None:
            future.set_exception(self.error)
        else:
            future.set_result(RewardOutput(list(self.values), 0.0, 0.0))
        return future


def sample(prompt, response, prompt_index):
    return Sample(tokens=torch.tensor(prompt + response), prompt_len=len(prompt), group=0, prompt_index=prompt_index)


SAMPLES = [sample([1, 2], [3, 4, EOS], 17), sample([5], [6, EOS, EOS], 4), sample([5], [EOS, 7], 4)]
RECORDS = {17: {"index": 17, "answer": "34", "group": None}, 4: {"index": 4, "answer": "6", "group": "add"}}


def exchange(runner, enabled=True):
    return RewardExchange(enabled=enabled, runner=runner, tokenizer=Tokenizer(), stop_token_ids=(EOS,), control=None,
                          timers=Timers())


def test_samples_go_as_text_with_their_records_and_rewards_come_back_timed():
    runner = Runner(values=[1.0, 0.0, 0.5])
    rewards = exchange(runner)
    future = rewards.send(SAMPLES, RECORDS)
    (batch,) = runner.sent
    assert batch.prompts == ["1 2", "5", "5"]
    assert batch.responses == ["3 4", "6", "9 7"]  # trailing stop ids go; one inside the response stays
    assert batch.records == [RECORDS[17], RECORDS[4], RECORDS[4]]
    assert rewards.receive(future) == [1.0, 0.0, 0.5]
    assert "reward_wait" in rewards.timers.pop()
    assert rewards.metrics([1.0, 0.0, 0.5]) == {"reward/mean": 0.5, "reward/min": 0.0, "reward/max": 1.0,
                                                "reward/count": 3.0}


def test_a_failed_reward_raises_its_error_naming_the_reward_and_the_record():
    error = RewardFailed("pkg.mod:fn", "raised ValueError: x on record 1 of 3 (id 4, prompt '5')", record=1)
    rewards = exchange(Runner(error=error))
    with pytest.raises(RewardFailed, match=r"reward 'pkg.mod:fn' raised ValueError: x on record 1 of 3 \(id 4"):
        rewards.receive(rewards.send(SAMPLES, RECORDS))


def test_a_batch_without_its_rewards_on_a_rank_that_computes_them_fails():
    with pytest.raises(RuntimeError, match="without its rewards"):
        exchange(Runner(values=[])).receive(None)


def test_a_worker_that_cannot_start_fails_at_start_up():
    rewards = exchange(Runner(ready_error=RewardFailed("pkg.mod:fn", "could not start: No module named 'pkg'")))
    with pytest.raises(RewardFailed, match="could not start: No module named 'pkg'"):
        rewards.wait_ready()


def test_a_rank_without_a_runner_sends_nothing_and_gets_no_rewards():
    rewards = exchange(None)
    assert rewards.send(SAMPLES, RECORDS) is None
    rewards.wait_ready()
    assert rewards.receive(None) is None


def test_without_rewards_nothing_is_waited_for_or_logged():
    rewards = exchange(None, enabled=False)
    assert rewards.receive(None) is None and rewards.metrics(None) == {}
    assert rewards.timers.pop() == {}


def test_gather_puts_every_share_s_rewards_at_its_rows_on_every_rank():
    """``rl.dynamic_sampling``'s view of a batch (TP=2 x DP=2: one rank of each share computes its rewards): every rank
    assembles the same rewards, each at the row it was computed for, whichever share it holds."""
    rows = [[0, 1, 4], [2, 3, 5]]  # the rows of shares 0 and 1, in the order each share's rewards were computed
    computed = {0: [0.5, 1.0, 2.0], 1: [0.0, -1.0, 3.0]}
    gathered = [[0, computed[0]], None, [1, computed[1]], None]  # ranks 0 and 2 compute; 1 and 3 hold no runner
    with unittest.mock.patch("megatron_gkd.trainer.reward_exchange.all_gather_msgpack", lambda value, group: gathered):
        found = [exchange(Runner(values=[]) if share in computed else None).gather(computed.get(share), rows, share)
                 for share in (0, 1, 0, 1)]
    assert found == [[0.5, 1.0, 0.0, -1.0, 2.0, 3.0]] * 4
    with unittest.mock.patch("megatron_gkd.trainer.reward_exchange.all_gather_msgpack",
                             lambda value, group: gathered[:2]), pytest.raises(AssertionError, match="shares"):
        exchange(None).gather(None, rows, 1)  # a share whose rewards no rank holds: an internal error, not zeros


def test_known_rewards_are_answered_at_once_on_the_ranks_that_compute_them():
    rewards = exchange(Runner(values=[]))
    assert rewards.receive(rewards.known([1.0, 0.0])) == [1.0, 0.0]
    assert exchange(None).known([1.0]) is None


def _grouped(groups: list[int]) -> list:
    """Samples as the metrics read them: their prompt group."""
    return [types.SimpleNamespace(group=group) for group in groups]


def test_the_share_of_prompt_groups_whose_rewards_differ_is_logged_for_groups_of_several_samples():
    rewards = exchange(object())
    # groups 3 (1, 0: differ), 5 (1, 1) and 8 (0, 0, 0): one of three teaches a group baseline anything
    metrics = rewards.metrics([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], _grouped([3, 3, 5, 5, 8, 8, 8]))
    assert metrics["reward/informative_groups"] == pytest.approx(1 / 3)
    assert "reward/informative_groups" not in rewards.metrics([1.0, 0.0], _grouped([0, 1]))  # one sample a prompt
    assert "reward/informative_groups" not in rewards.metrics([1.0, 0.0])

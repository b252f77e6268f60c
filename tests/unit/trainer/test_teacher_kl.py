""":class:`~megatron_gkd.trainer.eval.TeacherKL` alone (#31 item 2: it had no direct test), in a gloo world of one with
a fake batch flow and step runner: it measures nothing when the eval has fewer prompts than data-parallel ranks, routes
each prompt by its group, scores the eval answers forward only, without gradients and in eval mode (the student's
training mode restored after), and hands every rank the loss statistic of the source rank (None without one)."""

import types

import pytest
import torch
import torch.distributed as dist

from megatron_gkd.trainer.eval import TeacherKL

pytestmark = pytest.mark.usefixtures("gloo_world")  # conftest.py: a gloo world of one process

ROLLOUT = object()  # the eval's sampled answers: TeacherKL hands them to the flow untouched
SPECS = {"teacher": "the eval KL's spec"}


class Flow:
    """Records what it is asked: the scoring batch of the answers, and its micro-batches."""

    def __init__(self, data_parallel_size: int = 1):
        self.state = types.SimpleNamespace(data_parallel_size=data_parallel_size)
        self.calls = []

    def scoring_batch(self, rollout, prompt_indices, groups):
        self.calls.append(("scoring_batch", rollout, list(prompt_indices), list(groups)))
        return "batch"

    def prepare(self, batch, scoring=False):
        self.calls.append(("prepare", batch, scoring))
        return types.SimpleNamespace(microbatches=["mb0", "mb1"])


class Runner:
    """A step runner whose ``run`` records how it was called and returns ``stats``."""

    def __init__(self, stats):
        self.chunks = [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)]
        for chunk in self.chunks:
            chunk.train()
        self.stats, self.calls = stats, []

    def run(self, specs, microbatches, forward_only=False):
        self.calls.append(dict(specs=specs, microbatches=microbatches, forward_only=forward_only,
                               grad_enabled=torch.is_grad_enabled(), training=[c.training for c in self.chunks]))
        return self.stats


def teacher_kl(flow, runner, groups=None):
    return TeacherKL(flow, runner, SPECS, groups or {}, dist.group.WORLD, source_rank=0)


def test_fewer_eval_prompts_than_data_parallel_ranks_measure_nothing():
    flow, runner = Flow(data_parallel_size=4), Runner({"loss": 0.5})
    assert teacher_kl(flow, runner)(ROLLOUT, [0, 1, 2]) is None  # every data-parallel rank needs a share
    assert flow.calls == [] and runner.calls == []
    assert teacher_kl(Flow(data_parallel_size=4), runner)(ROLLOUT, [0, 1, 2, 3]) == 0.5


def test_the_answers_are_routed_by_group_and_scored_forward_only_in_eval_mode():
    flow, runner = Flow(), Runner({"loss": 0.125, "tokens": 9.0})
    groups = {5: "add2", 7: "add3"}  # a prompt without a group goes to the default teacher
    assert teacher_kl(flow, runner, groups)(ROLLOUT, [5, 7, 9]) == 0.125
    assert flow.calls == [("scoring_batch", ROLLOUT, [5, 7, 9], ["add2", "add3", None]), ("prepare", "batch", True)]
    (call,) = runner.calls
    assert call["specs"] is SPECS and call["microbatches"] == ["mb0", "mb1"] and call["forward_only"]
    assert not call["grad_enabled"] and call["training"] == [False, False]
    assert torch.is_grad_enabled() and all(chunk.training for chunk in runner.chunks)  # the training state is back


def test_no_statistics_no_kl():
    # The loss statistic lives on a last pipeline stage (source_rank, here the one rank): without one (a rank of
    # another stage, nothing scored) the source rank's None is what every rank gets, and the eval records no KL.
    assert teacher_kl(Flow(), Runner(None))(ROLLOUT, [0]) is None
    assert teacher_kl(Flow(), Runner({}))(ROLLOUT, [0]) is None

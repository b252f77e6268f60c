"""The schedulers' :class:`~megatron_gkd.trainer.schedulers.BatchPipeline` alone (#31 item 2), with a fake
producer: each schedule keeps exactly its staleness in flight, hands batches out in order, produces each batch
once, drains at the end and resumes past the trained batches."""

import pytest

from megatron_gkd.config.schedules import SCHEDULERS
from megatron_gkd.trainer.schedulers import BatchPipeline


def run(schedule: str, *, start: int = 0, num_batches: int = 6):
    """Trains every batch; returns the produced indices and, per update, the batches in flight beside it."""
    produced = []

    def produce(index):
        produced.append(index)
        return f"batch {index}"

    pipeline = BatchPipeline(produce, max_staleness=SCHEDULERS.get(schedule).max_staleness, start=start,
                             num_batches=num_batches)
    trained, ahead = [], []
    while True:
        try:
            index, handle = pipeline.next()
        except StopIteration:
            break
        assert handle == f"batch {index}"
        trained.append(index)
        ahead.append([i for i, _ in pipeline.in_flight])
    return produced, trained, ahead, pipeline


@pytest.mark.parametrize("schedule,staleness", [("sync", 0), ("one_step_off", 1), ("two_step_off", 2)])
def test_each_schedule_keeps_its_staleness_in_flight_and_trains_every_batch_once(schedule, staleness):
    produced, trained, ahead, pipeline = run(schedule)
    assert produced == trained == list(range(6))
    for index, in_flight in zip(trained, ahead):  # produced ahead with the weights before update(index)
        assert in_flight == list(range(index + 1, min(index + 1 + staleness, 6)))
    assert pipeline.num_produced == 6 and pipeline.num_sampled == 6


def test_a_resumed_run_starts_past_the_trained_batches():
    produced, trained, _, pipeline = run("two_step_off", start=4, num_batches=6)
    assert produced == trained == [4, 5]
    assert pipeline.num_sampled == 6 and pipeline.num_produced == 2


def test_nothing_past_the_run_is_produced():
    produced, trained, _, _ = run("two_step_off", num_batches=1)
    assert produced == trained == [0]

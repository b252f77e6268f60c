"""A batch's annotations: what is computed of its samples beside the teacher's rows, behind one interface.

The rewards (:class:`~megatron_gkd.trainer.reward_exchange.RewardExchange`) are the first annotator; a later one (a
second verifier, a judge, a classifier's score) is its own class with the same five calls, passed to the batch path
(``BatchFlow(annotators=...)``) and read on the batch by name (``batch.annotations[name]``), with no change to the
flow, the batch or the schedulers:

| when | call | collective |
|---|---|---|
| start-up | ``wait_ready()``: raises on every rank if one rank's annotator cannot work (a module that fails to import) | yes |
| sampling | ``send(samples, records) -> handle``: this rank's share goes out, computed meanwhile (on any thread) | no |
| update | ``receive(handle) -> value``: waits; a failure on any rank is raised on every rank (``comm.agree``) | yes |
| update | ``metrics(value, samples) -> {name: float}``: over the global batch, the same on every rank | yes |
| shutdown | ``close()`` | no |

Every rank makes every call (a rank that computes nothing takes part in the collectives with a None handle).

The failure policy is the teacher's: an annotation that fails stops the update on every rank, and the trainer keeps
the last complete step (``RunCheckpoints.save_after_failure``); no step trains on a missing annotation.

The teacher's exchange is not one of them: its requests are split between sampling and the update (a colocated
teacher is a collective of the training ranks) and its rows are cut into the micro-batches the loss terms read
(:class:`~megatron_gkd.trainer.teacher_exchange.TeacherExchange`).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class Annotator(Protocol):
    """One annotation of a batch's samples (see the module docstring for when each call runs)."""

    name: str
    """Where the batch keeps its value (``InFlight.annotations[name]``); unique among a run's annotators."""

    def wait_ready(self) -> None: ...

    def send(self, samples: Sequence, records: dict) -> Any:
        """``samples``: this rank's share (:class:`~megatron_gkd.trainer.batch.Sample`); ``records``: each prompt's
        fields by dataset row (``{"index", "answer", "group"}``)."""

    def receive(self, handle: Any) -> Any: ...

    def metrics(self, value: Any, samples: Sequence) -> dict[str, float]: ...

    def close(self) -> None: ...


class Annotations:
    """The run's annotators, called in order; each one's handle and value kept under its name."""

    def __init__(self, annotators: Sequence[Annotator]):
        names = [annotator.name for annotator in annotators]
        assert len(set(names)) == len(names), f"two annotators share a name: {names}"
        self.by_name = {annotator.name: annotator for annotator in annotators}

    def wait_ready(self) -> None:
        for annotator in self.by_name.values():
            annotator.wait_ready()

    def send(self, samples: Sequence, records: dict, known: dict[str, Any] | None = None) -> dict[str, Any]:
        """Each annotator's handle; ``known``: handles made already (e.g. rewards computed while the batch was drawn),
        whose annotators are not sent the samples again."""
        known = known or {}
        return {name: known[name] if name in known else annotator.send(samples, records)
                for name, annotator in self.by_name.items()}

    def receive(self, sent: dict[str, Any]) -> dict[str, Any]:
        return {name: annotator.receive(sent.get(name)) for name, annotator in self.by_name.items()}

    def metrics(self, values: dict[str, Any], samples: Sequence) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, annotator in self.by_name.items():
            metrics.update(annotator.metrics(values.get(name), samples))
        return metrics

    def close(self) -> None:
        """Closes every annotator, even past one that fails to close (the first error is raised after)."""
        errors = []
        for annotator in self.by_name.values():
            try:
                annotator.close()
            except Exception as error:  # noqa: BLE001 - raised below, once every annotator is closed
                errors.append(error)
        if errors:
            raise errors[0]

"""A batch's annotations: what is computed of its samples for the update, behind one interface.

The teacher's rows (:class:`~megatron_gkd.trainer.teacher_exchange.TeacherExchange`, name ``teacher``) and the
rewards (:class:`~megatron_gkd.trainer.reward_exchange.RewardExchange`, ``rewards``) are the first annotators; a later
one (a second verifier, a judge, a classifier's score) is its own class with the same five calls, passed to the batch
path (``BatchFlow(annotators=...)``) and read on the batch by name (``batch.annotations[name]``), with no change to the
flow, the batch or the schedulers:

| when | call | collective |
|---|---|---|
| start-up | ``wait_ready()``: raises on every rank if one rank's annotator cannot work (a module that fails to import) | yes |
| sampling | ``send(samples, records, index=, background=) -> handle``: this rank's share goes out, computed meanwhile | no* |
| update | ``receive(handle) -> value``: waits; a failure on any rank is raised on every rank (``comm.agree``) | yes |
| update | ``metrics(value, samples) -> {name: float}``: over the global batch, the same on every rank | yes |
| shutdown | ``close()`` | no |

Every rank makes every call, in the run's order of annotators (a rank that computes nothing takes part in the
collectives with a None handle). ``index`` is the batch's; ``background``: the samples were made on the rollout
thread while the training ranks train, so ``send`` may not start a collective of the training ranks (*a colocated
teacher is one: with ``background`` it is asked in ``receive``; otherwise in ``send``, as every rank makes the
samples together).

The failure policy is the teacher's: an annotation that fails stops the update on every rank, and the trainer keeps
the last complete step (``RunCheckpoints.save_after_failure``); no step trains on a missing annotation.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class Annotator(Protocol):
    """One annotation of a batch's samples (see the module docstring for when each call runs)."""

    name: str
    """Where the batch keeps its value (``InFlight.annotations[name]``); unique among a run's annotators."""

    def wait_ready(self) -> None: ...

    def send(self, samples: Sequence, records: dict, *, index: int, background: bool = False) -> Any:
        """``samples``: this rank's share (:class:`~megatron_gkd.trainer.batch.Sample`); ``records``: each prompt's
        fields by dataset row (``{"index", "answer", "group"}``); ``index``: the batch's; ``background``: see the
        module docstring."""

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

    def send(self, samples: Sequence, records: dict, known: dict[str, Any] | None = None, *, index: int,
             background: bool = False) -> dict[str, Any]:
        """Each annotator's handle of batch ``index``; ``known``: handles made already (e.g. rewards computed while
        the batch was drawn), whose annotators are not sent the samples again."""
        known = known or {}
        return {name: known[name] if name in known else annotator.send(samples, records, index=index,
                                                                       background=background)
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

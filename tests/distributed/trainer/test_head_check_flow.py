"""The trainer's batch flow refuses a hidden-signal head or hidden states that are not the teacher's.

TP=2 (two gloo ranks), each holding its shard of the head as the trainer builds it; the tiny assets' hf teacher
scores in this process (hidden states rounded to bf16 as the wire rounds them). Three off-policy batches through
``BatchFlow.produce`` / ``prepare`` with ``teacher.head_check_interval=2`` (checks at batches 0 and 2):

* the served teacher's own head passes every check (no false alarm at bf16 hidden states);
* the head of the same model with another seed (same shape, so every shape check passes) stops every rank at the
  first batch, the error naming ``teacher.head_checkpoint``, the disagreement in nats and the tolerance;
* a teacher whose hidden row is scaled by 1e4 (finite: the output validation passes it) is refused at batch 0,
  passes batch 1 (not checked) and is refused again at batch 2.
"""

import dataclasses
import pathlib
import types

import numpy as np
import pytest
import torch

from megatron_gkd.recipes.tiny import build_assets, build_checkpoint
from megatron_gkd.teacher.clients import TeacherClient, TeacherInfo
from megatron_gkd.testing import runs as harness
from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

RUN = ["trainer.mode=off_policy", "rollout.n=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
       "parallel.tensor_model_parallel_size=2", "student.dtype=bfloat16", "teacher.signal=hidden", "loss.type=jsd",
       "teacher.temperature=1.5", "teacher.head_check_interval=2", "eval.at_start=false", "eval.at_end=false"]
NUM_BATCHES = 3


class InProcessTeacher(TeacherClient):
    """The hf backend in this process; hidden states rounded to the wire's dtype, row 0 of the first reply of every
    batch multiplied by ``scale``, and every output validated as the zmq client validates it."""

    def __init__(self, backend, scale: float = 1.0):
        super().__init__(max_inflight=1)
        self.backend, self.scale = backend, scale

    def info(self) -> TeacherInfo:
        info = self.backend.info()
        return TeacherInfo(**{field.name: getattr(info, field.name) for field in dataclasses.fields(TeacherInfo)})

    def _score(self, batch):
        outputs = []
        for index, output in enumerate(self.backend.score(batch)):
            hidden = torch.from_numpy(output.hidden).to(getattr(torch, batch.hidden_dtype)).float().numpy()
            if index == 0:
                hidden[0] *= np.float32(self.scale)
            sequence = batch.sequences[index]
            outputs.append(dataclasses.replace(output, hidden=hidden).validate(
                sequence.num_response_tokens, batch.top_k, name=f"sequence {index}", sequence=sequence,
                hidden_size=hidden.shape[1]))
        return outputs


def _scenarios(assets: str, other: str) -> dict[str, list[str]]:
    """Per scenario, ``ok`` or the error of each batch's ``prepare`` on this rank (one spawn for all three)."""
    import torch.distributed as dist

    from megatron_gkd import parallel
    from megatron_gkd.config import load_config
    from megatron_gkd.data import load_prompts, load_tokenizer
    from megatron_gkd.teacher.backends import build_backend
    from megatron_gkd.trainer.components import build_teacher_head
    from megatron_gkd.trainer.flow import BatchFlow
    from megatron_gkd.trainer.metrics import Timers
    from megatron_gkd.trainer.teachers import Teachers

    assets = pathlib.Path(assets)
    backend = build_backend("hf", model=str(assets / "teacher"))
    results = {}
    for name, head, scale in (("right", assets / "teacher", 1.0), ("other_seed", other, 1.0),
                              ("scaled_row", assets / "teacher", 1e4)):
        overrides = harness.asset_overrides(assets) + RUN + [f"teacher.head_checkpoint={head}"]
        config = load_config(harness.CONFIG, overrides)
        state = parallel.initialize(config.parallel)
        try:
            tokenizer = load_tokenizer(config.student.tokenizer_path)
            teachers = Teachers(config)
            [teacher] = teachers
            teacher.client = InProcessTeacher(backend, scale)
            student = types.SimpleNamespace(vocab_size=512, dtype=torch.bfloat16)  # what build_teacher_head reads
            teacher.head = build_teacher_head(config.teacher, state, student, tokenizer)
            flow = BatchFlow(config, state, control=dist.new_group(backend="gloo"), dp_group=state.dp_gloo_group,
                             tokenizer=tokenizer, timers=Timers(), teachers=teachers)
            records = load_prompts(config.data.train_path, config.data, tokenizer, require_responses=True)
            outcomes = results[name] = []
            for index in range(NUM_BATCHES):
                batch = flow.produce(index, [records[i] for i in range(4 * index, 4 * index + 4)], {}, version=0)
                try:
                    flow.prepare(batch)
                    outcomes.append("ok")
                except Exception as error:  # noqa: BLE001 - the parent asserts on every rank's outcome
                    outcomes.append(f"{type(error).__name__}: {error}")
            teacher.client.close()
        finally:
            parallel.destroy()
    return results


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    """The tiny assets, a model of the teacher's shape with another seed (``recipes/tiny.py``'s teacher), and the
    outcomes of every scenario on each of the 2 ranks."""
    root = tmp_path_factory.mktemp("head_check")
    assets = build_assets(root / "assets", num_train=16, num_eval=4)
    other = build_checkpoint(root / "other_teacher", vocab_size=512, hidden_size=256, num_layers=4, num_heads=4,
                             intermediate_size=512, seed=11)
    return other, run_distributed(_scenarios, 2, args=(str(assets), str(other)))


def test_the_teachers_own_head_passes_every_check(per_rank):
    for rank, results in enumerate(per_rank[1]):
        assert results["right"] == ["ok"] * NUM_BATCHES, f"rank {rank}: {results['right']}"


def test_a_head_of_another_model_of_the_same_shape_stops_every_rank_at_the_first_batch(per_rank):
    other, ranks = per_rank
    for rank, results in enumerate(ranks):
        first = results["other_seed"][0]
        assert first.startswith("TeacherHeadMismatch"), f"rank {rank}: {results['other_seed']}"
        assert f"teacher.head_checkpoint={other}" in first and "teacher.head_check_tolerance" in first, first
        nats = float(first.split("by up to ")[1].split(" nats")[0])
        assert nats > 1.0, first


def test_a_hidden_row_scaled_by_1e4_is_refused_where_checked(per_rank):
    for rank, results in enumerate(per_rank[1]):
        outcomes = results["scaled_row"]
        refused = [outcome.split(":")[0] == "TeacherHeadMismatch" for outcome in outcomes]
        assert refused == [True, False, True], f"rank {rank}: {outcomes}"  # batch 1 is not checked
        assert "response token 0 of prompt" in outcomes[0], outcomes[0]  # the scaled row is the worst

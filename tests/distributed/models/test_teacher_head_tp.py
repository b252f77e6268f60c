"""At TP=2 the teacher head shard is split exactly like the student's own output layer.

A student loaded with ``load_hf`` from the same checkpoint as the teacher holds, on each TP rank, an
output layer (or, tied, an embedding) shard that ``load_teacher_head`` must reproduce bit for bit.
"""

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import make_tiny_checkpoint

pytestmark = pytest.mark.distributed


def _student_and_teacher_shards(path: str, vocab_size: int):
    from megatron.core import parallel_state as mpu

    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf
    from megatron_gkd.models.teacher_head import load_teacher_head

    parallel.initialize(tensor_model_parallel_size=2)
    [chunk] = load_hf(path)
    # Tied at PP=1: the output layer has no weight of its own and uses the embedding.
    weight = chunk.output_layer.weight
    student = (chunk.shared_embedding_or_output_weight() if weight is None else weight).detach().clone()
    teacher = load_teacher_head(path, student_vocab_size=vocab_size, tp_rank=mpu.get_tensor_model_parallel_rank(),
                                tp_size=mpu.get_tensor_model_parallel_world_size(), real_vocab_size=vocab_size,
                                dtype=student.dtype)
    parallel.destroy()
    return student, teacher


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"], ids=["untied", "tied"])
def test_teacher_head_shard_is_the_student_output_layer_shard(tmp_path, architecture):
    path = make_tiny_checkpoint(architecture, tmp_path / "ckpt", max_shard_size="200KB")
    shards = run_distributed(_student_and_teacher_shards, 2, args=(path, 256))
    for student, teacher in shards:
        assert student.shape == teacher.shape == (128, student.shape[1])
        assert torch.equal(student, teacher)
    assert not torch.equal(shards[0][1], shards[1][1])

"""A model loaded from HF (built without Megatron's initialisation) marks its tensor-parallel weights as
Megatron's initialisation would: without the marks, Megatron counts a split weight's gradient on TP
rank 0 only, so the global gradient norm (and the clipping that uses it) is wrong at TP > 1."""

import pytest

from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import make_tiny_checkpoint

pytestmark = pytest.mark.distributed

ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _marks(path: str, layout: dict):
    from megatron_gkd import parallel
    from megatron_gkd.models import build_model, load_hf, read_hf_config

    parallel.initialize(**layout)

    def marks(chunks):
        return {name: tuple(getattr(param, key, None) for key in ATTRIBUTES)
                for chunk in chunks for name, param in chunk.named_parameters()}

    initialised = marks(build_model(read_hf_config(path)))
    loaded = marks(load_hf(path))
    parallel.destroy()
    return initialised, loaded


@pytest.mark.parametrize("architecture, layout", [("Qwen3ForCausalLM", dict(tensor_model_parallel_size=2)),
                                                  ("Qwen3MoeForCausalLM", dict(expert_model_parallel_size=2))])
def test_loaded_weights_carry_the_tensor_parallel_marks_of_initialised_ones(tmp_path, architecture, layout):
    path = make_tiny_checkpoint(architecture, tmp_path / "ckpt")
    for initialised, loaded in run_distributed(_marks, 2, args=(path, layout)):
        assert sum(mark[0] is True for mark in initialised.values()) > 4
        assert loaded == initialised

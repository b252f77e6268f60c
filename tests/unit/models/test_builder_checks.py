"""The builder refuses a layout that does not split the model with the check the dry run and the trainer's start
make (``planning.splits.check_split``): one check, one message, whoever builds."""

import types

import pytest

from megatron_gkd.models.builder import transformer_config
from megatron_gkd.parallel import ParallelConfig
from megatron_gkd.testing.hf_models import SMOLLM2_LIKE


def _hf(**overrides) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, **SMOLLM2_LIKE, **overrides}


def _state(**sizes):
    return types.SimpleNamespace(config=ParallelConfig(**sizes))


def test_the_builder_names_both_head_counts_and_the_sizes_that_split():
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has 9 attention heads and 3 key/value heads, which do not "
                                         r"split across tensor_model_parallel_size=2 .* to 1 or 3"):
        transformer_config(_hf(), _state(tensor_model_parallel_size=2))
    assert transformer_config(_hf(), _state(tensor_model_parallel_size=3)).num_query_groups == 3


def test_the_builder_refuses_layers_that_do_not_split_over_the_stages():
    # Megatron-Core asserted this inside its layer builder ("num_layers should be divisible by ...").
    with pytest.raises(ValueError, match=r"has 2 layers, which do not split into pipeline_model_parallel_size=2 x "
                                         r"virtual_pipeline_model_parallel_size=2 chunks"):
        transformer_config(_hf(), _state(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2))

"""DeepSeek-V3 YaRN settings: Megatron's frequencies, cos/sin factor and softmax scale equal transformers'.

For each ``rope_parameters`` variant, transformers' own functions (``_compute_yarn_parameters`` and
the attention's ``yarn_apply_mscale``) are compared with what Megatron-Core computes from the fields
:func:`deepseek_v3_transformer_config` produces (``YarnRotaryEmbedding``, ``_yarn_get_mscale``), the
formula ``MultiLatentAttention`` uses for its softmax scale.
"""

import math

import pytest
import torch
from megatron.core.models.common.embeddings import YarnRotaryEmbedding, _yarn_get_mscale

from megatron_gkd.models.deepseek_v3 import deepseek_v3_transformer_config

TINY = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    first_k_dense_replace=1,
    max_position_embeddings=8192,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, original_max_position_embeddings=256, beta_fast=32, beta_slow=1)


def _transformers_side(rope_parameters):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    config = DeepseekV3Config(**TINY, rope_parameters=dict(rope_parameters))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scale = yarn_apply_mscale(config.rope_parameters, (TINY["qk_nope_head_dim"] + TINY["qk_rope_head_dim"]) ** -0.5)
    return config.to_dict(), inv_freq, attention_factor, scale


@pytest.mark.parametrize(
    "params",
    [
        dict(YARN, factor=40.0, mscale=1.0, mscale_all_dim=1.0),  # DeepSeek-V3
        dict(YARN, factor=40.0, mscale=0.707, mscale_all_dim=0.707),  # DeepSeek-V2 style
        dict(YARN, factor=16.0, mscale=1.0, mscale_all_dim=0.5),
        dict(YARN, factor=16.0, mscale=1.0),  # no mscale_all_dim: no softmax factor
        dict(YARN, factor=16.0, mscale_all_dim=1.0),  # no mscale: transformers' cos/sin factor m(f, 1)
        dict(YARN, factor=8.0),
    ],
    ids=["v3", "v2", "unequal", "no_all_dim", "no_mscale", "bare"],
)
def test_yarn_matches_transformers(params):
    hf_config, hf_inv_freq, hf_attention_factor, hf_scale = _transformers_side(params)
    fields = deepseek_v3_transformer_config(hf_config)
    rope_dim = fields["qk_pos_emb_head_dim"]

    embedding = YarnRotaryEmbedding(
        rope_dim,
        rotary_base=fields["rotary_base"],
        scaling_factor=fields["rotary_scaling_factor"],
        original_max_position_embeddings=fields["original_max_position_embeddings"],
        beta_fast=fields["beta_fast"],
        beta_slow=fields["beta_slow"],
        mscale=fields["mscale"],
        mscale_all_dim=fields["mscale_all_dim"],
        use_cpu_initialization=True,
    )
    emb, concentration = embedding.get_emb(5)  # [s, 1, 1, rope_dim]: angles, twice
    angles = emb[:, 0, 0, : rope_dim // 2].cpu()
    torch.testing.assert_close(angles, torch.outer(torch.arange(5.0), hf_inv_freq), rtol=1e-6, atol=1e-6)
    assert concentration == pytest.approx(hf_attention_factor, rel=1e-12)

    # MultiLatentAttention: softmax_scale = m(factor, mscale_all_dim)^2 / sqrt(q_head_dim)
    mscale = _yarn_get_mscale(fields["rotary_scaling_factor"], fields["mscale_all_dim"])
    softmax_scale = mscale * mscale / math.sqrt(fields["qk_head_dim"] + rope_dim)
    assert softmax_scale == pytest.approx(hf_scale, rel=1e-12)


def test_plain_rope_has_no_softmax_factor():
    fields = deepseek_v3_transformer_config(dict(TINY, rope_parameters=dict(rope_type="default", rope_theta=5e4)))
    assert fields["rope_type"] == "rope" and fields["rotary_base"] == 5e4
    assert _yarn_get_mscale(fields["rotary_scaling_factor"], fields["mscale_all_dim"]) == 1.0


def test_dense_first_layers_and_routing_fields():
    hf = dict(
        TINY,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        moe_intermediate_size=16,
        routed_scaling_factor=2.5,
    )
    fields = deepseek_v3_transformer_config(hf)
    assert fields["moe_layer_freq"] == [0, 0, 1, 1]
    assert fields["moe_router_score_function"] == "sigmoid" and fields["moe_router_enable_expert_bias"]
    assert (fields["moe_router_num_groups"], fields["moe_router_group_topk"]) == (4, 2)
    assert fields["moe_router_topk_scaling_factor"] == 2.5
    assert fields["moe_shared_expert_intermediate_size"] == 32
    assert fields["q_lora_rank"] == 32 and deepseek_v3_transformer_config(dict(hf, q_lora_rank=None))["q_lora_rank"] is None

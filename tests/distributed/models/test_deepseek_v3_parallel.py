"""A tiny Megatron DeepSeek-V3 (MLA, shared + routed experts, first layer dense) on the CPU.

Every layout loads the same weights (a deterministic full TP=1 state, sharded per rank), runs under
Megatron's ``DistributedDataParallel`` and ``finalize_model_grads`` (the gradient reductions a training
step does), and must give the TP=1 logits and gradients: TP=2 on the same batch; EP=2 with one sample
per rank, where the reference sees both samples (data-parallel averaging halves the gradients).
"""

import zlib

import pytest
import torch

from megatron_gkd.models import global_name
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import TINY_CONFIGS

TINY_DEEPSEEK_V3 = dict(
    TINY_CONFIGS["DeepseekV3ForCausalLM"], architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=3
)
SEQ_LENGTH = 12



def _shard_layout(name, param, state):
    """``(dim, rank, size, num_parts)`` of a parameter's TP shard, or ``None`` when it is replicated."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    expert = ".local_experts." in name
    size = state.config.resolved_expert_tensor_parallel_size if expert else state.config.tensor_model_parallel_size
    if size == 1:
        return None
    from megatron.core import parallel_state as mpu

    rank = mpu.get_expert_tensor_parallel_rank() if expert else state.tp_rank
    parts = 2 if name.endswith("linear_fc1.weight") else 1  # gated MLPs stack [gate; up]
    return param.partition_dim, rank, size, parts


def _full_value(name, shape):
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.endswith(("layernorm.weight", "layer_norm_weight", "final_layernorm.weight")):
        return 1.0 + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
    if name.endswith("expert_bias"):
        return 0.05 * torch.randn(shape, generator=generator, dtype=torch.float64)
    return 0.08 * torch.randn(shape, generator=generator, dtype=torch.float64)


def _load_reference_weights(model, state):
    from megatron_gkd.parallel import shard_for_rank

    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias"))
    for name, tensor in tensors.items():
        full_name = global_name(model, name)
        layout = _shard_layout(name, tensor, state)
        shape = list(tensor.shape)
        if layout is not None:
            shape[layout[0]] *= layout[2]
        value = _full_value(full_name, shape)
        if layout is not None:
            dim, rank, size, parts = layout
            value = shard_for_rank(value, dim, rank, size, num_parts=parts)
        with torch.no_grad():
            tensor.copy_(value.to(tensor.dtype))


def _batch():
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, TINY_DEEPSEEK_V3["vocab_size"], (2, SEQ_LENGTH), generator=generator)


def _forward_backward(tp, ep, etp=None):
    """One layout: logits ``[b, s, v]`` (full vocabulary) and ``{global name: (grad, layout)}``."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import MLATransformerConfig

    from megatron_gkd import parallel
    from megatron_gkd.models.deepseek_v3 import (
        deepseek_v3_gpt_model_kwargs,
        deepseek_v3_layer_spec,
        deepseek_v3_transformer_config,
    )

    hf_config = TINY_DEEPSEEK_V3
    state = parallel.initialize(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    try:
        parallel.seed(1234)
        config = MLATransformerConfig(
            **deepseek_v3_transformer_config(hf_config),
            **state.config.transformer_config_kwargs(),
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            use_cpu_initialization=True,
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=deepseek_v3_layer_spec(config, use_transformer_engine=False),
            **deepseek_v3_gpt_model_kwargs(hf_config),
        )
        _load_reference_weights(model, state)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
        wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        wrapped.zero_grad_buffer()
        # Eval mode: Megatron refuses MoE under TP without sequence parallelism in training mode, and
        # the local spec's torch norms cannot do sequence parallelism (that needs TE or Apex). Dropout
        # is 0, so eval mode changes nothing else; gradients are computed all the same.
        model.eval()
        tokens = _batch()
        # Fixed weights of a linear loss on the logits, so that the gradients are a known function.
        weights = torch.randn(*tokens.shape, hf_config["vocab_size"], generator=torch.Generator().manual_seed(3))
        if ep > 1:  # one sample per expert-parallel (= data-parallel) rank
            tokens = tokens[state.dp_rank : state.dp_rank + 1]
            weights = weights[state.dp_rank : state.dp_rank + 1]
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        logits = wrapped(tokens, position_ids, attention_mask=None)  # [b, s, v/tp]
        vocab = logits.shape[-1]
        weights = weights[..., state.tp_rank * vocab : (state.tp_rank + 1) * vocab]
        (logits * weights).sum().backward()
        finalize_model_grads([wrapped])
        full_logits = parallel.gather_tp(logits.detach(), -1, state.tp_group)
        grads = {
            global_name(model, name): (param.main_grad.detach().clone(), _shard_layout(name, param, state))
            for name, param in model.named_parameters()
        }
        return dict(logits=full_logits, grads=grads, dp_rank=state.dp_rank, dp_size=state.data_parallel_size)
    finally:
        parallel.destroy()


def _merged_grads(results):
    """Full gradients: TP shards merged; anything else is equal on its holders after the reductions."""
    from megatron_gkd.parallel import merge_shards

    merged = {}
    for name in sorted({n for r in results for n in r["grads"]}):
        holders = [r for r in results if name in r["grads"]]
        layout = holders[0]["grads"][name][1]
        if layout is not None:
            dim, _, size, parts = layout
            by_rank = {r["grads"][name][1][1]: r["grads"][name][0] for r in holders}
            merged[name] = merge_shards([by_rank[rank] for rank in range(size)], dim, num_parts=parts)
        else:
            merged[name] = holders[0]["grads"][name][0]
    return merged


def _assert_layout_matches_reference(results, reference, split_batch):
    """``split_batch``: each data-parallel rank ran one sample of the reference batch."""
    if split_batch:
        logits = torch.cat([r["logits"] for r in sorted(results, key=lambda r: r["dp_rank"])], dim=0)
    else:
        logits = results[0]["logits"]
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-5)
    grads = _merged_grads(results)
    scale = 1.0 / results[0]["dp_size"] if split_batch else 1.0  # DDP averages over data-parallel ranks
    expected = reference["grads"]
    assert sorted(grads) == sorted(expected)
    for name, (want, _) in expected.items():
        want = want * scale
        # fp32 sums in another order: tolerance relative to the gradient's scale.
        atol = 1e-5 * float(want.abs().max())
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    # The comparison is meaningful only if every parameter, experts included, received gradient.
    assert all(value[0].abs().sum() > 0 for value in expected.values())


# (name, tp, ep, etp), run one after the other in one 2-process spawn; "tp1" is two data-parallel
# replicas of the whole model. TP=2 keeps experts replicated over TP (expert_tensor_parallel_size=1):
# without sequence parallelism every TP rank routes the same tokens, and with experts split over TP
# (ETP=2) the allgather dispatcher hands each expert both ranks' copies, doubling the routed-expert
# gradients (measured: exactly 2x). Megatron forbids that layout in training mode, and sequence
# parallelism needs TE/Apex norms, which the local spec does not have.
LAYOUTS = (("tp1", 1, 1, None), ("tp2", 2, 1, 1), ("ep2", 1, 2, None))


def _all_layouts(layouts):
    return {name: _forward_backward(tp, ep, etp) for name, tp, ep, etp in layouts}


@pytest.fixture(scope="module")
def runs():
    """``[per rank {layout: result}]``."""
    return run_distributed(_all_layouts, 2, args=(LAYOUTS,))


@pytest.fixture(scope="module")
def reference(runs):
    return runs[0]["tp1"]


@pytest.mark.distributed
def test_tp1_forward_backward_runs(reference):
    logits = reference["logits"]
    assert logits.shape == (2, SEQ_LENGTH, TINY_DEEPSEEK_V3["vocab_size"])
    assert torch.isfinite(logits).all()
    names = set(reference["grads"])
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names  # first_k_dense_replace = 1: dense
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in names
    assert "decoder.layers.2.mlp.experts.local_experts.7.linear_fc2.weight" in names
    assert "decoder.layers.1.self_attention.linear_q_down_proj.weight" in names


@pytest.mark.distributed
def test_tp2_matches_tp1(runs, reference):
    _assert_layout_matches_reference([r["tp2"] for r in runs], reference, split_batch=False)


@pytest.mark.distributed
def test_ep2_matches_tp1(runs, reference):
    _assert_layout_matches_reference([r["ep2"] for r in runs], reference, split_batch=True)

"""References for the pruning tests, written with ``transformers`` alone and apart from ``megatron_gkd.prune``.

* :func:`hf_importance`: the importance statistics of an HF checkpoint in float64, read with hooks on the HF modules
  (the decoder layers' inputs and outputs, ``o_proj``'s and ``down_proj``'s inputs, the norms' outputs).
* :func:`hf_skipped_losses`: the LM loss with each layer skipped, in float64.
* :func:`prune_by_hand`: an HF model cut to kept indices through the modules' weights viewed per head, the
  independent twin of the exporter-side cut.
* :func:`make_gqa_checkpoint`: a tiny tied Llama with SmolLM2's odd head counts (9 query heads, 3 key/value heads).
"""

from __future__ import annotations

import functools
import os

import torch

from megatron_gkd.testing.hf_models import make_tiny_checkpoint

# SmolLM2-135M's attention and tied embedding (9 heads over 3 groups) at tiny sizes.
GQA_ODD = dict(hidden_size=144, head_dim=16, num_attention_heads=9, num_key_value_heads=3, intermediate_size=96,
               num_hidden_layers=4, tie_word_embeddings=True, max_position_embeddings=256,
               rope_parameters=dict(rope_type="default", rope_theta=100000.0))


def make_gqa_checkpoint(path: str | os.PathLike, *, seed: int = 0) -> str:
    """A tiny ``LlamaForCausalLM`` shaped like SmolLM2's attention (9 / 3 heads, tied embeddings)."""
    return make_tiny_checkpoint("LlamaForCausalLM", path, seed=seed, **GQA_ODD)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _float64_model(path: str | os.PathLike):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float64, attn_implementation="eager")
    return model.eval()


def _loss(model, tokens: torch.Tensor) -> float:
    logits = model(input_ids=tokens).logits
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()))


def _adder(target: torch.Tensor, statistic):
    """A forward (pre-)hook that adds ``statistic(module input, module output)`` to ``target`` in place."""
    def hook(module, args, output=None):
        target.add_(statistic(args[0], output[0] if isinstance(output, tuple) else output))
    return hook


# Per-token statistics of a module's input and output ([b, s, ...]), summed over the tokens.
def _cosine(before, after):
    return torch.nn.functional.cosine_similarity(before, after, dim=-1).sum()


def _head_norms(head_dim, context, _):
    return context.unflatten(-1, (-1, head_dim)).norm(dim=-1).sum(dim=(0, 1))


def _abs_input(activation, _):
    return activation.abs().sum(dim=(0, 1))


def _abs_output(_, normed):
    return normed.abs().sum(dim=(0, 1))


def hf_importance(path: str | os.PathLike, tokens: torch.Tensor) -> dict:
    """Float64 means over ``tokens`` ``[n, s]``: ``cosine`` ``[L]`` (of each layer's input and output), ``heads``
    ``[L, H]`` (L2 norm of each head's attention output), ``ffn`` ``[L, F]`` (abs of the down projection's input),
    ``hidden`` ``[L, h]`` (abs of the two norms' outputs, summed), ``final_hidden`` ``[h]`` and ``loss``."""
    model = _float64_model(path)
    config = model.config
    layers, head_dim = config.num_hidden_layers, _head_dim(config)
    sums = dict(cosine=torch.zeros(layers, dtype=torch.float64),
                heads=torch.zeros(layers, config.num_attention_heads, dtype=torch.float64),
                ffn=torch.zeros(layers, config.intermediate_size, dtype=torch.float64),
                hidden=torch.zeros(layers, config.hidden_size, dtype=torch.float64),
                final_hidden=torch.zeros(config.hidden_size, dtype=torch.float64))
    handles, head_norms = [], functools.partial(_head_norms, head_dim)
    for index, layer in enumerate(model.model.layers):
        handles += [layer.register_forward_hook(_adder(sums["cosine"][index], _cosine)),
                    layer.self_attn.o_proj.register_forward_pre_hook(_adder(sums["heads"][index], head_norms)),
                    layer.mlp.down_proj.register_forward_pre_hook(_adder(sums["ffn"][index], _abs_input))]
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            handles.append(norm.register_forward_hook(_adder(sums["hidden"][index], _abs_output)))
    handles.append(model.model.norm.register_forward_hook(_adder(sums["final_hidden"], _abs_output)))
    with torch.no_grad():
        loss = _loss(model, tokens)
    for handle in handles:
        handle.remove()
    return {**{name: value / tokens.numel() for name, value in sums.items()}, "loss": loss}


def hf_skipped_losses(path: str | os.PathLike, tokens: torch.Tensor) -> torch.Tensor:
    """``[L]``: the float64 LM loss on ``tokens`` with layer ``i`` passing its input through."""
    model = _float64_model(path)
    losses = []
    for layer in model.model.layers:
        layer.forward = lambda hidden_states, *args, **kwargs: hidden_states
        with torch.no_grad():
            losses.append(_loss(model, tokens))
        del layer.forward
    return torch.tensor(losses, dtype=torch.float64)


def prune_by_hand(path: str | os.PathLike, kept, *, dtype: torch.dtype = torch.float32):
    """The HF model of ``path`` cut to ``kept`` (a :class:`~megatron_gkd.prune.KeptIndices`) module by module."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=dtype).eval()
    config = teacher.config.__class__.from_dict(teacher.config.to_dict())
    config.num_hidden_layers, config.hidden_size = len(kept.layers), len(kept.hidden)
    config.num_attention_heads, config.num_key_value_heads = len(kept.heads[0]), len(kept.query_groups[0])
    head_dim = _head_dim(teacher.config)
    config.intermediate_size, config.head_dim = len(kept.ffn[0]), head_dim
    if getattr(config, "layer_types", None):
        config.layer_types = [teacher.config.layer_types[layer] for layer in kept.layers]
    student = type(teacher)(config).to(dtype).eval()
    hidden = kept.hidden

    def per_head(weight, dim):  # rows (dim 0) or columns (dim 1) as [heads, head_dim]
        return weight.unflatten(dim, (-1, head_dim))

    with torch.no_grad():
        student.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight[:, hidden])
        student.model.norm.weight.copy_(teacher.model.norm.weight[hidden])
        if not config.tie_word_embeddings:
            student.lm_head.weight.copy_(teacher.lm_head.weight[:, hidden])
        for position, index in enumerate(kept.layers):
            source, target = teacher.model.layers[index], student.model.layers[position]
            heads, groups, ffn = kept.heads[position], kept.query_groups[position], kept.ffn[position]
            for name, units in (("q_proj", heads), ("k_proj", groups), ("v_proj", groups)):
                projection = getattr(source.self_attn, name)
                getattr(target.self_attn, name).weight.copy_(per_head(projection.weight, 0)[units][:, :, hidden].flatten(0, 1))
                if projection.bias is not None:
                    getattr(target.self_attn, name).bias.copy_(per_head(projection.bias, 0)[units].flatten())
            target.self_attn.o_proj.weight.copy_(per_head(source.self_attn.o_proj.weight[hidden], 1)[:, heads].flatten(1))
            for name in ("q_norm", "k_norm"):
                if hasattr(source.self_attn, name):
                    getattr(target.self_attn, name).weight.copy_(getattr(source.self_attn, name).weight)
            target.mlp.gate_proj.weight.copy_(source.mlp.gate_proj.weight[ffn][:, hidden])
            target.mlp.up_proj.weight.copy_(source.mlp.up_proj.weight[ffn][:, hidden])
            target.mlp.down_proj.weight.copy_(source.mlp.down_proj.weight[hidden][:, ffn])
            target.input_layernorm.weight.copy_(source.input_layernorm.weight[hidden])
            target.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight[hidden])
    return student

"""Tiny random Hugging Face checkpoints and logits through both stacks, for tests and benchmarks.

Checkpoints are built by ``transformers`` itself from a config (nothing is downloaded), every tensor
is re-drawn at random (HF initialises norms to one and biases to zero, which would hide mapping
mistakes), and saved with ``save_pretrained``. ``megatron_logits`` runs this rank's chunks through
Megatron's pipeline schedule (``forward_only``) and gathers the vocabulary shards.
"""

from __future__ import annotations

import os

import torch

from megatron_gkd.parallel import forward_logits

# head_dim >= 32 everywhere (vLLM's CPU attention rejects 16); sizes that split across TP=2 and EP=2.
_COMMON = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

TINY_CONFIGS: dict[str, dict] = {
    # Llama 3.1-style RoPE scaling and untied embeddings.
    "LlamaForCausalLM": dict(
        _COMMON,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    ),
    # qkv bias, tied embeddings.
    "Qwen2ForCausalLM": dict(_COMMON, rope_parameters=dict(rope_type="default", rope_theta=1000000.0), tie_word_embeddings=True),
    # q/k norm, explicit head_dim different from hidden/heads, linear RoPE scaling.
    "Qwen3ForCausalLM": dict(
        _COMMON,
        hidden_size=96,
        head_dim=32,
        rope_parameters=dict(rope_type="linear", rope_theta=1000000.0, factor=2.0),
        tie_word_embeddings=False,
    ),
    # routed experts (normalised top-k), one dense layer among MoE layers.
    "Qwen3MoeForCausalLM": dict(
        _COMMON,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        mlp_only_layers=[1],
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    # Multi-latent attention with a low-rank query, YaRN, shared + grouped routed experts with the
    # score-correction bias, first layer dense.
    "DeepseekV3ForCausalLM": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        topk_method="noaux_tc",  # real DeepSeek-V3 configs carry it (vLLM needs it for the bias)
        num_nextn_predict_layers=0,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
}

# The MLA dims vLLM's CPU kernel accepts (``kv_lora_rank + qk_rope_head_dim = 576``; the tiny config's 64 is refused:
# "Head dimension 64 is not supported by MLA"): a tiny DeepSeek-V3 that a vLLM engine can load.
VLLM_MLA_DIMS = dict(kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)

# SmolLM2-135M-Instruct's odd shapes at a tiny size (make_tiny_checkpoint("LlamaForCausalLM", path, **SMOLLM2_LIKE)):
# 9 query heads over 3 key/value heads (TP 1 or 3 only), head_dim 64 (576 wide, as SmolLM2), tied embeddings, and a
# table of 252 rows for a 250-id tokenizer (save_chat_tokenizer's default): 2 padding rows, and rows that split
# over TP 3 but not 5.
SMOLLM2_LIKE = dict(
    vocab_size=252,
    hidden_size=576,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    rope_parameters=dict(rope_type="default", rope_theta=100000.0),
)

# SmolLM2-135M-Instruct's chat template, verbatim: ChatML with a default system prompt.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
    "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def save_chat_tokenizer(directory: str | os.PathLike, chat_template: str | None = SMOLLM2_CHAT_TEMPLATE, *,
                        num_ids: int = 250, word: str = "w", eos_token: str = "<|im_end|>") -> str:
    """A word-level tokenizer of ``num_ids`` ids (SmolLM2's special tokens, then ``{word}0``, ``{word}1``, ...) with
    ``chat_template``, saved in HF format beside a checkpoint; another ``word`` gives another vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*CHAT_SPECIAL_TOKENS, *(f"{word}{i}" for i in range(num_ids - len(CHAT_SPECIAL_TOKENS)))]
    core = Tokenizer(models.WordLevel({token: i for i, token in enumerate(words)}, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                                        eos_token=eos_token, pad_token=eos_token,
                                        additional_special_tokens=list(CHAT_SPECIAL_TOKENS))
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(os.fspath(directory))
    return os.fspath(directory)


# ~370 MB in float32 (12 layers of 768 wide, 2048 MLP, 8192 vocabulary): the memory test and benchmark.
LARGE_LLAMA = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=6,
    num_key_value_heads=6,
    vocab_size=8192,
)


def _config_class(architecture: str):
    import transformers

    model_class = getattr(transformers, architecture)
    return model_class, model_class.config_class


def make_tiny_checkpoint(
    architecture: str,
    path: str | os.PathLike,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides,
) -> str:
    """Writes a random ``architecture`` checkpoint (``TINY_CONFIGS`` + ``overrides``) to ``path``.

    ``max_shard_size`` (e.g. ``"200KB"``) splits it into several files with an index, as large
    checkpoints are.
    """
    model_class, config_class = _config_class(architecture)
    config = config_class(**{**TINY_CONFIGS.get(architecture, {}), **overrides})
    torch.manual_seed(seed)
    model = model_class(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.05
            param.copy_(noise + 1.0 if "norm" in name else noise)
    model = model.to(dtype)
    model.save_pretrained(os.fspath(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return os.fspath(path)


def hf_logits(path: str | os.PathLike, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, v]`` of the checkpoint at ``path`` through ``transformers`` (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def megatron_logits(chunks, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits ``[b, s, v]`` on the last pipeline stage (:func:`megatron_gkd.parallel.forward_logits`)."""
    return forward_logits(chunks, tokens)


def read_safetensors_dir(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``path`` (round-trip checks compare these)."""
    from safetensors import safe_open

    tensors = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), framework="pt") as handle:
                tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors

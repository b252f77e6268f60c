"""Tiny GGUF checkpoints written on the fly from tiny HF Llama models (nothing is downloaded).

``make_tiny_gguf(directory)`` writes two copies of one random model: ``reference/``, an HF checkpoint saved by
``transformers`` (its tokenizer built with ``tokenizers``), and ``tiny.gguf``, the same model laid out as llama.cpp's
converter writes it: GGUF tensor names, the q/k projection rows permuted into llama.cpp's rotary order, Llama
metadata, a byte-level BPE tokenizer with control tokens, and a chat template that adds a default system prompt (as
SmolLM2's does). With a quantized ``tensor_type``
(``Q8_0``, ``Q4_1``...) the 2-D weights are quantized by the ``gguf`` package and ``reference/`` holds their values
dequantized by ``gguf`` itself, so a reader that dequantizes correctly reproduces the reference exactly; ``F16``
rounds them to half precision the same way. 1-D tensors (norms) stay float32, as llama.cpp keeps them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np
import torch

DEFAULT_SYSTEM_PROMPT = "You are a tiny test model."
# SmolLM2's template, shortened: a system turn with the default prompt unless the conversation brings its own.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "a n", "Ġ a", "Ġ m")  # 266 tokens: splits over TP=2
# ids of SPECIAL_TOKENS: they come first in the vocabulary.
BOS_ID, EOS_ID = 1, 2
# Llama with grouped-query attention (4 query heads, 2 KV heads: the k rows are permuted per KV head), head_dim 32
# (vLLM's CPU attention needs 32, 64 or 128) and sizes that split over two tensor-parallel ranks.
CONFIG = dict(hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rope_parameters=dict(rope_type="default", rope_theta=100000.0),
              # GGUF stores the epsilon as a float32: the reference holds that value, so both compute alike.
              rms_norm_eps=float(np.float32(1e-5)), bos_token_id=BOS_ID, eos_token_id=EOS_ID)
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


@dataclasses.dataclass(frozen=True)
class TinyGGUF:
    """Paths of one tiny model: the GGUF file and the HF checkpoint holding the same (dequantized) weights."""

    gguf: pathlib.Path
    reference: pathlib.Path


def tokens() -> list[str]:
    """The vocabulary: the control tokens, the 256 byte-level symbols, then one token per merge."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [*SPECIAL_TOKENS, *bytes_to_unicode().values(), *("".join(merge.split()) for merge in MERGES)]


def reference_tokenizer(vocab: list[str]):
    """The GGUF's tokenizer built directly with ``tokenizers`` (GPT-2's byte-level BPE), for the reference checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(vocab={token: index for index, token in enumerate(vocab)},
                               merges=[tuple(merge.split()) for merge in MERGES]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=vocab[BOS_ID], eos_token=vocab[EOS_ID],
                                   chat_template=CHAT_TEMPLATE)


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of an HF Llama tensor."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest.removesuffix('.weight')]}.weight"


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's two rotary halves (its RoPE pairs adjacent rows).
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _permute_back(weight: np.ndarray, num_heads: int) -> np.ndarray:
    return weight.reshape(num_heads, weight.shape[0] // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _encode(array: np.ndarray, tensor_type: str):
    """``(stored array, its GGML type or None for float32, the float32 values a reader must recover)``."""
    import gguf

    if array.ndim == 1 or tensor_type == "F32":
        return array, None, array
    if tensor_type == "F16":
        half = array.astype(np.float16)
        return half, None, half.astype(np.float32)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    stored = gguf.quants.quantize(array, qtype)
    return stored, qtype, gguf.quants.dequantize(stored, qtype).astype(np.float32)


def make_tiny_gguf(directory: str | os.PathLike, *, tensor_type: str = "F32", tied: bool = True, seed: int = 0) -> TinyGGUF:
    """Writes ``directory/tiny.gguf`` and ``directory/reference`` (see the module docstring).

    Args:
        directory: created if missing.
        tensor_type: how 2-D weights are stored: ``F32``, ``F16`` or a GGML quantization type the ``gguf`` package
            can write (``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``).
        tied: whether the output layer is the embedding (no ``output.weight``, as SmolLM2).
        seed: the random weights.
    """
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = tokens()
    config = LlamaConfig(vocab_size=len(vocab), tie_word_embeddings=tied, **CONFIG)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    # Fresh values everywhere: transformers initialises norms to one, which would hide a swapped norm.
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    stored = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = (torch.randn(param.shape, generator=generator) * 0.05 + (1.0 if "norm" in name else 0.0)).numpy()
            permuted = next((_permute(value, n) for key, n in heads.items() if f".{key}." in name), value)
            array, qtype, recovered = _encode(permuted, tensor_type)
            stored[gguf_name(name)] = (array, qtype)
            # The reference holds what the GGUF holds, back in HF's row order.
            unpermuted = next((_permute_back(recovered, n) for key, n in heads.items() if f".{key}." in name), recovered)
            param.copy_(torch.from_numpy(np.ascontiguousarray(unpermuted)))
    model.save_pretrained(directory / "reference")
    reference_tokenizer(vocab).save_pretrained(directory / "reference")

    path = directory / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * (len(vocab) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, (array, qtype) in stored.items():
        if tied and name == "output.weight":
            continue
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(gguf=path, reference=directory / "reference")

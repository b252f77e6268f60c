"""GGUF -> HF: a llama.cpp checkpoint dequantized into a plain HF directory (config, safetensors, tokenizer, chat
template) that ``transformers``, vLLM and :func:`megatron_gkd.models.load_hf` read.

``transformers`` does the reading: it maps GGUF tensor names to HF ones, undoes llama.cpp's q/k row permutation,
dequantizes every GGML type it knows (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants) and rebuilds the tokenizer, chat
template included, from the metadata. What it loads is a model marked as GGUF-quantized, which ``save_pretrained``
refuses; so its state dict is written with ``safetensors`` and its config without the marker. Which architectures
work is the intersection of ``transformers``' GGUF support (llama, qwen2, qwen3, qwen3_moe...) and
:func:`megatron_gkd.models.supported_architectures`.

Callers normally go through :func:`megatron_gkd.models.resolve_checkpoint`, which caches the result; this module
writes one directory.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_gkd.planning.gguf_config import read_gguf_config, require_gguf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` for a dtype or its name.

    Raises:
        ValueError: any other dtype.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"a GGUF checkpoint is dequantized to one of {sorted(DTYPES)}, not dtype={dtype}")
    return name


def convert_gguf(file: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype | str | None) -> None:
    """Writes the HF checkpoint of the GGUF ``file`` into the directory ``out`` (created; must be empty).

    Args:
        file: a GGUF file.
        out: the output directory.
        dtype: what the weights are dequantized to (``float32``, ``bfloat16``, ``float16``); None writes the config
            and the tokenizer only (for readers that need no weights: the tokenizer, the planner).

    Raises:
        ImportError: ``gguf`` or ``accelerate`` is missing (the message says what to install).
        ValueError: a dtype other than the three.
    """
    require_gguf()
    from transformers import AutoTokenizer

    name = dtype_name(dtype) if dtype is not None else None
    directory, file_name = os.path.split(os.path.abspath(os.fspath(file)))
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    if os.listdir(out):
        raise FileExistsError(f"{out} is not empty; a GGUF is converted into an empty directory")
    if name is None:
        with open(os.path.join(out, "config.json"), "w") as handle:
            json.dump(read_gguf_config(file), handle, indent=2)
    else:
        _save_weights(directory, file_name, out, DTYPES[name])
    # The tokenizer comes from the same metadata: vocabulary, merges, special tokens and the chat template, which
    # save_pretrained writes as chat_template.jinja.
    AutoTokenizer.from_pretrained(directory, gguf_file=file_name).save_pretrained(out)


def _save_weights(directory: str, file_name: str, out: str, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file_name, dtype=dtype)
    # Written here rather than by model.save_pretrained, which refuses a GGUF-marked model and, once
    # torch.distributed is initialised, writes on rank 0 only (transformers 5.19): the rank that converts may be any.
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        # A tied output layer shares the embedding's storage; HF stores it once, under the embedding's name
        # (the first in module order).
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the GGUF marker: these weights are plain floats
    config["architectures"] = [type(model).__name__]  # what save_pretrained records
    config["dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)

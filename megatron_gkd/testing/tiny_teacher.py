"""A tiny random causal LM and word-level tokenizer saved as a HF checkpoint (tests, benchmarks).

Nothing is downloaded: the model is built from a config with random weights and the tokenizer is a
word-level vocabulary ``w0 .. w{n-1}`` built with ``tokenizers``. ``head_dim`` is 64 because vLLM's CPU
attention accepts only 32/64/128. Weights use a wide initialisation so that logits are spread out and
top-k orderings are not decided by rounding noise.
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch


def build_tiny_teacher(directory: str | pathlib.Path, vocab_size: int = 512, tokenizer_size: int | None = None,
                       num_layers: int = 2, hidden_size: int = 128, seed: int = 0) -> pathlib.Path:
    """Writes a random Llama checkpoint with its tokenizer to ``directory`` and returns the path.

    Args:
        vocab_size: rows of the embedding/output tables.
        tokenizer_size: ids the tokenizer defines (default ``vocab_size``; smaller means a padded table).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = pathlib.Path(directory)
    tokenizer_size = tokenizer_size or vocab_size
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(tokenizer_size - 3)]
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.save_pretrained(directory)

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=hidden_size // 64,
                         num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return directory


def reference_logprobs(directory: str | pathlib.Path, token_ids: np.ndarray, response_start: int,
                       vocab_limit: int | None = None) -> np.ndarray:
    """Float64 log-probs ``[T, V]`` of response rows straight from transformers (row t predicts token t)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(token_ids, dtype=torch.long)[None]).logits[0]
    logits = logits[response_start - 1:-1, :vocab_limit]
    return torch.log_softmax(logits, dim=-1).numpy()

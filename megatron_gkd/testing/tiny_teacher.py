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
                       num_layers: int = 2, hidden_size: int = 128, seed: int = 0,
                       num_key_value_heads: int = 1) -> pathlib.Path:
    """Writes a random Llama checkpoint with its tokenizer to ``directory`` and returns the path.

    Args:
        vocab_size: rows of the embedding/output tables.
        tokenizer_size: ids the tokenizer defines (default ``vocab_size``; smaller means a padded table).
        num_key_value_heads: key/value heads (tensor parallelism needs a multiple of its size).
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
                         num_key_value_heads=num_key_value_heads, head_dim=64, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return directory


class ReferenceTeacher:
    """The tiny teacher in float64 transformers: the reference every backend is compared with."""

    def __init__(self, directory: str | pathlib.Path):
        from transformers import AutoModelForCausalLM

        # Eager experts: transformers' default grouped matmul for MoE layers rejects float64.
        self._model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                           experts_implementation="eager").eval()

    @torch.no_grad()
    def logprobs(self, token_ids: np.ndarray, response_start: int, temperature: float = 1.0,
                 vocab_limit: int | None = None) -> np.ndarray:
        """Log-probs ``[T, V]`` of the response rows (row t predicts response token t)."""
        logits = self._model(input_ids=torch.as_tensor(token_ids, dtype=torch.long)[None]).logits[0]
        logits = logits[response_start - 1:-1, :vocab_limit] / temperature
        return torch.log_softmax(logits, dim=-1).numpy()

    def assert_matches(self, output, token_ids: np.ndarray, response_start: int, top_k: int,
                       temperature: float = 1.0, requested_ids: np.ndarray | None = None,
                       vocab_limit: int | None = None, atol: float = 1e-4, rtol: float = 1e-5) -> None:
        """Top-k ids identical, log-probs within ``atol + rtol * |reference|``, for every row including 0
        and the last.

        The relative part is float32's: a backend's rounding error grows with the magnitude of the log-prob
        (about 80 ulps at the tails, -17 on these teachers). An absolute bound alone held on one CPU and
        failed on another by 4% at a -16.8 tail entry (1.04e-4, relative 9.3e-6).

        Ids may differ only between entries whose float64 log-probs lie within ``tie_tol`` (1e-5) of
        each other: float32 rounding can order such near-ties either way. Each reported id must still
        carry its own reference log-prob.
        """
        tie_tol = 1e-5
        reference = self.logprobs(token_ids, response_start, temperature, vocab_limit)
        rows = len(token_ids) - response_start
        order = np.argsort(-reference, axis=1, kind="stable")
        ids = order[:, :top_k]
        assert output.topk_ids.shape == (rows, top_k)
        ranked = np.take_along_axis(reference, order[:, :top_k + 1], 1)  # [T, k+1] incl. the next one
        gaps = np.full((rows, top_k), np.inf)
        gaps[:, 1:] = ranked[:, :top_k - 1] - ranked[:, 1:top_k]
        below = ranked[:, :top_k] - ranked[:, 1:top_k + 1] if ranked.shape[1] > top_k else gaps
        near_tie = np.minimum(gaps, below) < tie_tol
        mismatch = output.topk_ids != ids
        assert not (mismatch & ~near_tie).any(), (
            f"top-k ids differ at (row, rank) {np.argwhere(mismatch & ~near_tie)[:5].tolist()}")
        np.testing.assert_allclose(output.topk_logprobs, np.take_along_axis(reference, ids, 1), atol=atol,
                                   rtol=rtol)
        np.testing.assert_allclose(output.topk_logprobs, np.take_along_axis(reference, output.topk_ids, 1),
                                   atol=atol, rtol=rtol)
        response = np.asarray(token_ids[response_start:])
        np.testing.assert_allclose(output.token_logprobs, reference[np.arange(rows), response], atol=atol,
                                   rtol=rtol)
        if requested_ids is not None:
            np.testing.assert_allclose(output.requested_logprobs,
                                       np.take_along_axis(reference, requested_ids, 1), atol=atol,
                                       rtol=rtol)

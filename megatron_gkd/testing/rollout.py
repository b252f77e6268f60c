"""References for rollout tests: a tiny Llama checkpoint and ``transformers`` in float64.

The checkpoint is ``hf_models``' tiny Llama with two heads of ``head_dim`` 64 (vLLM's CPU attention
accepts 32/64/128) and two KV heads (Megatron splits them over TP=2). It has no tokenizer: engines
are driven with token ids (vLLM with ``skip_tokenizer_init=True``).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from megatron_gkd.testing.hf_models import make_tiny_checkpoint

EOS_TOKEN_ID = 2


def make_rollout_checkpoint(path: str | os.PathLike, seed: int = 0, **overrides) -> str:
    """Writes the tiny Llama used by the rollout tests and benchmark; returns its path."""
    settings = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, bos_token_id=1,
                    eos_token_id=EOS_TOKEN_ID, max_position_embeddings=2048)
    return make_tiny_checkpoint("LlamaForCausalLM", path, seed=seed, **{**settings, **overrides})


class HFReference:
    """The checkpoint in float64 ``transformers``: greedy continuations and per-position log-probs."""

    def __init__(self, path: str | os.PathLike):
        from transformers import AutoModelForCausalLM

        self._model = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float64).eval()

    @torch.no_grad()
    def logprobs(self, prompt: Sequence[int], response: Sequence[int]) -> torch.Tensor:
        """``[T, v]`` log-softmax rows predicting each response token (row t predicts token t)."""
        tokens = torch.tensor([list(prompt) + list(response)])
        logits = self._model(input_ids=tokens).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], max_tokens: int, stop_ids: Sequence[int] = (EOS_TOKEN_ID,)) -> list[int]:
        """Greedy continuation, ending after a stop id or ``max_tokens`` tokens."""
        tokens = list(prompt)
        response: list[int] = []
        for _ in range(max_tokens):
            token = int(self._model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax())
            tokens.append(token)
            response.append(token)
            if token in stop_ids:
                break
        return response


def assert_rollout_matches(batch, reference: HFReference, atol: float = 1e-4, tie_tol: float = 1e-5) -> None:
    """Every sample's rollout log-probs equal the reference's within ``atol``; top-k ids (if any) equal
    the reference top-k except between near-ties (float64 log-probs within ``tie_tol``)."""
    for i in range(batch.num_samples):
        rows = reference.logprobs(batch.prompt(i), batch.response(i))  # [T, v]
        response = torch.tensor(batch.response(i))
        expected = rows[torch.arange(len(response)), response]
        torch.testing.assert_close(batch.logprobs(i).double(), expected, atol=atol, rtol=0)
        topk = batch.topk(i)
        if topk is None:
            continue
        k = topk.shape[1]
        ranked = torch.sort(rows, dim=-1, descending=True).values[:, : k + 1]  # [T, k+1]
        chosen = torch.gather(rows, 1, topk)  # reference log-probs of the reported ids
        # Reported ids carry the reference's k largest values, in order, up to ties.
        torch.testing.assert_close(chosen, ranked[:, :k], atol=tie_tol + atol, rtol=0)
        assert len(set(topk.flatten().tolist())) > 1 and (topk >= 0).all()

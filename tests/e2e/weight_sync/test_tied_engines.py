"""Every supported architecture, tied and untied, into every rollout engine that can hold it: three loads of new
weights, each changing every tensor (the embedding included), must each reach the engine.

What a sync sends for a tied model is the embedding alone (HF stores the tensor once; the trainer's plan exports it
once). vLLM 0.32's in-place reload then updated the embedding but never reprocessed the head that shares it, so on the
CPU it kept sampling from the head it started with (megatron_gkd/weight_sync/reload_logs.py).

After each load the engine's prompt log-probs must have moved and, for the dense architectures, equal transformers'
on the same weights (1e-4); after the third, they must equal those of a new engine started from a checkpoint of the
third weights (vLLM's MoE log-probs differ from transformers' by 0.04-0.11 on these models, so that is the MoE
reference). The hf
engine holds no mixture of experts (it refuses one, tested in tests/unit/rollout/test_hf_engine.py).

vLLM 0.32's DeepSeek-V3 has no tied head (real DeepSeek-V3 checkpoints are untied): a tied one is left with the head
it was built with, and its first load fails naming it instead of sampling from a random head.

The default tier runs a tied Qwen2 in both engines and an untied Llama in the hf one (suite time); the slow tier every
combination.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_gkd.rollout import build_engine
from megatron_gkd.testing.hf_models import VLLM_MLA_DIMS, make_tiny_checkpoint, read_safetensors_dir
from megatron_gkd.testing.weight_sync import make_engine

pytestmark = pytest.mark.e2e

PROMPTS = [[3, 17, 42, 9, 100, 5, 61, 2], [7, 7, 120, 1, 99]]
NUM_SYNCS = 3
TOLERANCE = 1e-4
MOE = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")
DEFAULT_TIER = {("Qwen2ForCausalLM", "vllm", True), ("LlamaForCausalLM", "hf", False), ("Qwen2ForCausalLM", "hf", True)}


def _cases():
    for architecture in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", *MOE):
        for engine in ("vllm", "hf"):
            if engine == "hf" and architecture in MOE:
                continue
            for tied in (False, True):
                if tied and engine == "vllm" and architecture == "DeepseekV3ForCausalLM":
                    continue  # vLLM never ties DeepSeek-V3's head: test_a_tied_deepseek_v3_fails_its_first_vllm_load
                marks = () if (architecture, engine, tied) in DEFAULT_TIER else (pytest.mark.slow,)
                yield pytest.param(architecture, engine, tied, marks=marks,
                                   id=f"{architecture}-{engine}-{'tied' if tied else 'untied'}")


def _sync_tensors(model, path) -> list[tuple[str, torch.Tensor]]:
    """What a weight sync sends: every tensor of the checkpoint, under its checkpoint name (transformers keeps some
    fused in memory, e.g. DeepSeek-V3's experts, and writes them per expert), once (a tied head is its embedding)."""
    model.save_pretrained(os.fspath(path))
    return sorted(read_safetensors_dir(path).items())


def _transformers_logprobs(model) -> torch.Tensor:
    values = []
    with torch.no_grad():
        for prompt in PROMPTS:
            logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1]
            values.append(torch.log_softmax(logits.double(), dim=-1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0])
    return torch.cat(values)


def _engine(kind: str, path: str):
    if kind == "vllm":
        return make_engine(path)
    return build_engine("hf", model=path, max_model_len=128)


@pytest.fixture(autouse=True)
def _one_process_vllm(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.mark.parametrize("architecture, kind, tied", list(_cases()))
def test_three_loads_that_change_the_embedding_reach_the_engine(tmp_path, architecture, kind, tied):
    from transformers import AutoModelForCausalLM

    dims = VLLM_MLA_DIMS if architecture == "DeepseekV3ForCausalLM" else {}
    path = make_tiny_checkpoint(architecture, tmp_path / "start", seed=11, tie_word_embeddings=tied, **dims)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    engine = _engine(kind, path)
    try:
        previous = engine.prompt_logprobs(PROMPTS)
        generator = torch.Generator().manual_seed(3)
        for version in range(1, NUM_SYNCS + 1):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 0.05)
            engine.load_weights(_sync_tensors(model, tmp_path / f"v{version}"), version=version)
            got = engine.prompt_logprobs(PROMPTS)
            moved = (got - previous).abs().max().item()
            assert moved > 1e-2, f"sync {version}: the engine's log-probs did not move ({moved:.1e})"
            if architecture not in MOE:
                error = (got - _transformers_logprobs(model)).abs().max().item()
                assert error < TOLERANCE, f"sync {version}: engine vs transformers, max |log-prob error| {error:.2e}"
            previous = got
    finally:
        engine.close()
    fresh = _engine(kind, os.fspath(tmp_path / f"v{NUM_SYNCS}"))
    try:
        error = (fresh.prompt_logprobs(PROMPTS) - previous).abs().max().item()
    finally:
        fresh.close()
    assert error < TOLERANCE, f"engine after {NUM_SYNCS} syncs vs one started on those weights: {error:.2e}"


@pytest.mark.slow
def test_a_tied_deepseek_v3_fails_its_first_vllm_load_naming_the_head(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_gkd.weight_sync import WeightSyncError

    path = make_tiny_checkpoint("DeepseekV3ForCausalLM", tmp_path / "start", seed=11, tie_word_embeddings=True,
                                **VLLM_MLA_DIMS)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(path)
    try:
        with pytest.raises(WeightSyncError, match=r"ParallelLMHead x1; weights not loaded: lm_head\.weight$"):
            engine.load_weights(_sync_tensors(model, tmp_path / "v1"), version=1)
        assert engine.stale
    finally:
        engine.close()

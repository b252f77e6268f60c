"""A model whose tables are longer than its tokenizer (Qwen3: 151,669 ids in 151,936 rows) never samples a
padding row from the vllm rollout engine (issue #21).

The checkpoint is a tiny random Qwen3 with 576 rows for a 512-id tokenizer whose padding rows are made to
hold almost all the probability (transformers confirms it), so without the engine's bias nearly every sampled
token would be padding; the engine is told the tokenizer's size and samples none.
"""

import pytest
import torch

from megatron_gkd.recipes import tiny
from megatron_gkd.rollout import SamplingConfig, build_engine

pytestmark = pytest.mark.e2e

TOKENS, ROWS = 512, 576
PROMPTS = [[1, 17, 99, 3, 250], [1, 42], [1, 7, 7, 7, 8, 9, 10, 11]]


def _padding_mass(model, prompts) -> float:
    """The least probability any prompt's next token puts on the padding rows."""
    with torch.no_grad():
        return min(model(torch.tensor([p])).logits[0, -1].softmax(-1)[TOKENS:].sum().item() for p in prompts)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    directory = tiny.build_checkpoint(tmp_path_factory.mktemp("padded_table"), vocab_size=ROWS, seed=5)
    model = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        # Padding rows along the prompts' mean last hidden state: large logits there, wherever they are.
        hidden = torch.cat([model.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]).mean(0)
        model.lm_head.weight[TOKENS:] = 4.0 * hidden / hidden.norm() + 0.1 * model.lm_head.weight[TOKENS:]
    assert _padding_mass(model, PROMPTS) > 0.9, "the padding rows must hold most of the mass for the test to mean anything"
    model.save_pretrained(directory)
    return directory


def test_padding_rows_are_never_sampled(model_dir):
    engine = build_engine("vllm", model=str(model_dir), max_model_len=64, skip_tokenizer_init=True,
                          kv_cache_memory_bytes=32 << 20, vocab_size=TOKENS)
    try:
        batch = engine.generate(PROMPTS, SamplingConfig(temperature=1.0, max_tokens=16, n=8, seed=3, logprobs_k=4))
    finally:
        engine.close()
    generated = batch.response_ids[batch.response_mask]
    assert generated.numel() >= len(PROMPTS) * 8  # at least one token per sample
    assert int(generated.max()) < TOKENS, f"sampled padding rows: {sorted(set(generated[generated >= TOKENS].tolist()))}"


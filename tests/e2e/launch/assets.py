"""Tiny assets of the 671B flow on one CPU machine: a random tiny DeepSeek-V3 teacher and a random tiny
Qwen3 student that share one word-level tokenizer, and prompt files."""

from __future__ import annotations

import pathlib

from megatron_gkd.recipes import tiny
from megatron_gkd.testing.hf_models import TINY_CONFIGS, make_tiny_checkpoint

VOCAB_SIZE = TINY_CONFIGS["DeepseekV3ForCausalLM"]["vocab_size"]


def build_deepseek_flow_assets(out: pathlib.Path) -> pathlib.Path:
    """``teacher`` (tiny DeepSeek-V3: MLA, shared + routed experts), ``student`` (tiny Qwen3), both with
    the same tokenizer, ``train.jsonl`` and ``eval.jsonl`` under ``out`` (kept when ``out/READY`` exists)."""
    if (out / "READY").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    make_tiny_checkpoint("DeepseekV3ForCausalLM", out / "teacher", seed=1, bos_token_id=tiny.BOS_ID,
                         eos_token_id=tiny.EOS_ID)
    tiny.build_checkpoint(out / "student", vocab_size=VOCAB_SIZE, hidden_size=128, num_layers=2, num_heads=2,
                          intermediate_size=256, seed=2)
    for name in ("teacher", "student"):
        tiny.build_tokenizer(out / name, VOCAB_SIZE)
    tiny.write_prompts(out / "train.jsonl", 64, vocab_size=VOCAB_SIZE, seed=3)
    tiny.write_prompts(out / "eval.jsonl", 8, vocab_size=VOCAB_SIZE, seed=4)
    (out / "READY").write_text("tiny DeepSeek-V3 teacher, tiny Qwen3 student, one tokenizer, prompts\n")
    return out

"""Where vLLM's DeepSeek-V3 departs from transformers': prompt log-probs of tiny random checkpoints.

transformers' ``DeepseekV3ForCausalLM`` is the reference Megatron is tested against
(``tests/distributed/models/test_deepseek_v3_hf_parity.py``). This script builds one tiny random
checkpoint per variant (MLA dims vLLM's CPU kernel accepts: ``kv_lora_rank + qk_rope_head_dim = 576``),
scores one prompt with both and prints the largest |log-prob difference| per variant, so that the
component where vLLM differs can be read off (YaRN vs plain RoPE, dense vs MoE, top-k vs top-1).

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/deepseek_v3_vllm_parity.py [variant ...]

Each variant starts its own vLLM engine in a fresh process (about a minute each on a 2-core host).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from megatron_gkd.testing.hf_models import TINY_CONFIGS, VLLM_MLA_DIMS

# The tested tiny config (routing, YaRN, MTP off) at MLA dims vLLM's CPU kernel accepts.
BASE = dict(
    TINY_CONFIGS["DeepseekV3ForCausalLM"],
    vocab_size=256,
    hidden_size=128,
    intermediate_size=192,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    **VLLM_MLA_DIMS,
    max_position_embeddings=1024,
    bos_token_id=0,
    eos_token_id=1,
    rope_parameters=dict(TINY_CONFIGS["DeepseekV3ForCausalLM"]["rope_parameters"], original_max_position_embeddings=256),
)
DEFAULT_ROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0))
NO_GROUPS = dict(n_group=1, topk_group=1)
VARIANTS = {
    "yarn-moe": {},
    "yarn-dense": dict(first_k_dense_replace=3),
    "rope-dense": dict(DEFAULT_ROPE, first_k_dense_replace=3),
    "rope-moe": DEFAULT_ROPE,
    "yarn-moe-ungrouped": NO_GROUPS,
    "yarn-moe-ungrouped-scale1": dict(NO_GROUPS, routed_scaling_factor=1.0),
    "yarn-moe-top1": dict(NO_GROUPS, num_experts_per_tok=1, routed_scaling_factor=1.0),
}


def _make_checkpoint(path: str, overrides: dict):
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**BASE, **overrides}))
    generator = torch.Generator().manual_seed(0)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    with torch.no_grad():
        for name, tensor in tensors.items():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.05 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return model


def _score_variant(name: str) -> float:
    import torch
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as path:
        model = _make_checkpoint(path, VARIANTS[name])
        tokens = torch.randint(2, BASE["vocab_size"], (24,), generator=torch.Generator().manual_seed(5)).tolist()
        with torch.no_grad():
            reference = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
        llm = LLM(
            model=path,
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=128,
            gpu_memory_utilization=0.05,
            enforce_eager=True,
        )
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        prompt_logprobs = llm.generate([{"prompt_token_ids": tokens}], params)[0].prompt_logprobs
        return max(
            abs(prompt_logprobs[i][tokens[i]].logprob - float(reference[i - 1, tokens[i]]))
            for i in range(1, len(tokens))
        )


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "--one":
        print(f"{argv[1]:<28} max |log-prob difference| {_score_variant(argv[1]):.2e}", flush=True)
        return
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for name in argv or list(VARIANTS):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        result = subprocess.run(
            [sys.executable, __file__, "--one", name], env=env, capture_output=True, text=True, check=False
        )
        lines = [line for line in result.stdout.splitlines() if "max |log-prob difference|" in line]
        print(lines[-1] if lines else f"{name:<28} failed:\n{result.stderr[-2000:]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

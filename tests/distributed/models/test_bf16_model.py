"""A bf16 student is bf16 throughout, as Megatron makes it on a GPU (Transformer Engine norms follow
``params_dtype``; Megatron's training script casts the whole model with ``Float16Module``): every
parameter, the local spec's torch norms included, holds the checkpoint's values rounded to bf16. The
optimizer then keeps float32 main weights of all of them, and weight sync sends nothing but bf16.

``save_hf`` writes the dtype asked for (default: the model's), and ``config.json`` says which."""

import json

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import make_tiny_checkpoint, read_safetensors_dir

pytestmark = pytest.mark.distributed


def _load_and_export(path: str, out: str):
    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf, save_hf
    from megatron_gkd.models.export import export_hf_weights
    from megatron_gkd.trainer.optim import OptimizerConfig, build_optimizer, wrap_for_training

    parallel.initialize()
    chunks = load_hf(path, dtype=torch.bfloat16)
    dtypes = {name: param.dtype for chunk in chunks for name, param in chunk.named_parameters()}
    exported = dict(export_hf_weights(chunks))
    save_hf(chunks, f"{out}/default")
    save_hf(chunks, f"{out}/float32", dtype=torch.float32)
    optimizer = build_optimizer(OptimizerConfig(), wrap_for_training(chunks, OptimizerConfig()), dtype=torch.bfloat16)
    [inner] = optimizer.chained_optimizers if hasattr(optimizer, "chained_optimizers") else [optimizer]
    main = [p.dtype for group in inner.fp32_from_float16_groups for p in group]
    fp32_kept = [p for group in inner.fp32_from_fp32_groups for p in group]
    parallel.destroy()
    return dtypes, exported, main, len(fp32_kept)


def test_a_bf16_model_is_bf16_throughout_and_exports_the_dtype_asked_for(tmp_path):
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt")
    [(dtypes, exported, main, num_fp32_kept)] = run_distributed(_load_and_export, 1, args=(path, str(tmp_path)))
    norms = [name for name in dtypes if "layernorm" in name]
    assert norms and set(dtypes.values()) == {torch.bfloat16}, {n: d for n, d in dtypes.items() if d != torch.bfloat16}
    # The optimizer's float32 main copy covers every weight; none is left training in float32 as it is.
    assert len(main) == len(dtypes) and set(main) == {torch.float32} and num_fp32_kept == 0
    source = read_safetensors_dir(path)
    assert exported.keys() == source.keys()
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, source[name].to(torch.bfloat16)), name
    for kind, dtype in (("default", torch.bfloat16), ("float32", torch.float32)):
        written = read_safetensors_dir(tmp_path / kind)
        assert {t.dtype for t in written.values()} == {dtype}, kind
        assert all(torch.equal(written[n], exported[n].to(dtype)) for n in exported), kind
        config = json.loads((tmp_path / kind / "config.json").read_text())
        assert config.get("dtype", config.get("torch_dtype")) == str(dtype).removeprefix("torch."), kind

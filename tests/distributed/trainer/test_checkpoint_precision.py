"""Checkpoints resume in the precision they were saved in. A bf16 student (float32 main weights in Megatron's
mixed-precision optimizer) saves and loads back its bf16 weights and float32 main weights exactly; loading
it into a float32 run, or a float32 checkpoint into a bf16 run, is refused with the key to set."""

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import make_tiny_checkpoint

pytestmark = pytest.mark.distributed


def _build(path: str, dtype: torch.dtype):
    from megatron_gkd.models import load_hf
    from megatron_gkd.trainer.optim import OptimizerConfig, build_lr_scheduler, build_optimizer, wrap_for_training

    config = OptimizerConfig(lr=3e-3)
    chunks = wrap_for_training(load_hf(path, dtype=dtype), config)
    optimizer = build_optimizer(config, chunks, dtype=dtype)
    return chunks, optimizer, build_lr_scheduler(config, optimizer, num_steps=10)


def _main_weights(optimizer) -> list[torch.Tensor]:
    [inner] = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p.detach().clone() for group in inner.fp32_from_float16_groups for p in group]


def _save_then_load(path: str, root: str, cases: list[tuple[str, str]]) -> list[dict]:
    from megatron_gkd import parallel
    from megatron_gkd.testing.weight_sync import train
    from megatron_gkd.trainer.checkpointing import load_checkpoint, save_checkpoint

    results = []
    for index, (saved, loaded) in enumerate(cases):
        state = parallel.initialize()
        chunks, optimizer, scheduler = _build(path, getattr(torch, saved))
        train(chunks, optimizer, 2, chunks[0].module.hf_model_info.hf_config["vocab_size"])
        weights = {name: p.detach().clone() for name, p in chunks[0].named_parameters()}
        main = _main_weights(optimizer) if saved != "float32" else []
        save_checkpoint(f"{root}/{index}", 2, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler,
                        data_state={}, parallel_state=state)
        fresh, fresh_optimizer, fresh_scheduler = _build(path, getattr(torch, loaded))
        try:
            load_checkpoint(f"{root}/{index}", model_chunks=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler,
                            parallel_state=state)
        except Exception as error:  # noqa: BLE001 - the test reads which error it was
            results.append({"error": f"{type(error).__name__}: {error}"})
            continue
        finally:
            parallel.destroy()
        # Moved by the 2 steps, so equal main weights come from the checkpoint, not from the fresh model.
        results.append({"same_weights": all(torch.equal(p, weights[name]) for name, p in fresh[0].named_parameters()),
                        "same_main": [torch.equal(a, b) for a, b in zip(_main_weights(fresh_optimizer), main)],
                        "num_main": len(main)})
    return results


def test_checkpoints_resume_in_the_precision_they_were_saved_in(tmp_path):
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt")
    cases = [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "bfloat16")]
    [(same, *refused)] = run_distributed(_save_then_load, 1, args=(path, str(tmp_path / "root"), cases))
    assert same.get("same_weights") and same["num_main"] > 0 and all(same["same_main"]), same
    for (saved, loaded), result in zip(cases[1:], refused):
        assert f"ValueError: {tmp_path}/root/" in result.get("error", ""), result
        assert f"was saved by a {saved} run (student.dtype={saved}) and this run trains in {loaded}" in result["error"]
        assert f"resume with student.dtype={saved}" in result["error"]

"""The accelerator path on one device (an NVIDIA GPU so far): correctness against the host references, and
speed and memory as ratios.

    python benchmarks/accelerator_path.py --out DIR [--parts env parity losses loss_speed fused trainer
                                          two_ranks_one_device] [--assets DIR] [--cpu-reference FILE]

Each part runs in its own spawned rank under the platform's collectives (world size 1) and a failing part
does not stop the others; every figure goes to ``DIR/accelerator_path.json`` (``--json``), rewritten after
each part.

  env         torch, the device runtime, the collectives library, the device; whether Transformer Engine
              and apex import (without them the model providers use Megatron-Core's local layer spec)
  parity      random HF checkpoints (Llama, Qwen2, Qwen3, Qwen3-MoE) through ``load_hf`` onto the GPU:
              Megatron-Core's logits against transformers' on the host, float32 (TF32 off)
  losses      every case of the loss tests, top-k (fp64, fp32, bf16; fused and unfused) and hidden-state
              (fp64, fp32), on the GPU against the float64 host reference: errors normalised so <= 1 passes
  loss_speed  V=151,936 rows (151,669 real), N tokens, teacher top-64: forward+backward milliseconds and
              peak extra GPU memory of every loss, against the floor (an fp32 log_softmax forward+backward
              of the same logits) and the naive dense formula (fp32 autograd); the loss and gradient at
              this size against float64 on the GPU
  fused       the output layer and forward KL, fused (chunked) against unfused, at N tokens, hidden H
  trainer     the trainer's entry point on the device, 3 off-policy steps at TP=1 on the tiny assets, fp32
              and bf16: losses against the same run on the host (``--cpu-reference``, written by
              ``--platform cpu --parts trainer`` on a CPU machine) and bf16 against fp32
  two_ranks_one_device  two ranks on the one device over the platform's collectives (the weight-sync
              layouts need one device per rank)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

import torch

from megatron_gkd.platform import PLATFORM_NAMES, detect
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.losses import LOSS_CONFIGS

REPO = pathlib.Path(__file__).resolve().parents[1]
PARITY_ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
TRAINER_STEPS = ["parallel.tensor_model_parallel_size=1"]


def _timed(fn, repeats: int) -> dict:
    """Median milliseconds of ``fn`` (device finished) and its peak GPU memory above what was live before
    (0 on the host, where ``--platform cpu`` only tries the script out at small sizes)."""
    from megatron_gkd import platform

    fn()  # warm-up
    times = []
    for _ in range(repeats):
        platform.synchronize()
        start = time.perf_counter()
        fn()
        platform.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    before = platform.memory_allocated()
    platform.max_memory_allocated(reset=True)
    fn()
    platform.synchronize()
    return {"ms": statistics.median(times), "peak_mib": (platform.max_memory_allocated() - before) / 2**20}


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def env_body() -> dict:
    from megatron_gkd import platform

    found = platform.describe()
    for module in ("transformer_engine", "apex", "megatron.core", "transformers", "vllm"):
        try:
            imported = __import__(module, fromlist=["__version__"])
            found[module] = getattr(imported, "__version__", "imported")
        except Exception as error:  # noqa: BLE001 - recorded, not raised
            found[module] = f"absent ({type(error).__name__})"
    return found


def parity_body(checkpoints: dict[str, str], tokens: torch.Tensor) -> dict:
    """Rank body: logits of each checkpoint through load_hf on the GPU (moved to the host)."""
    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf
    from megatron_gkd.testing.hf_models import megatron_logits

    parallel.initialize()  # TF32 matrix products are off: torch's default
    found = {}
    for name, path in checkpoints.items():
        chunks = load_hf(path, dtype=torch.float32)
        found[name] = {"device": str(next(chunks[0].parameters()).device),
                       "logits": megatron_logits(chunks, tokens).cpu()}
    parallel.destroy()
    return found


def losses_body() -> dict:
    from megatron_gkd import platform
    from megatron_gkd.testing import hidden_losses, losses

    device = platform.device()
    topk = losses.check_all_cases(device=device)
    hidden = hidden_losses.check_everything(device=device)
    fused = losses.check_fused_against_unfused(chunk_size=7, device=device)
    worst = {}
    for row in topk:
        key = f"topk/{row['dtype']}"
        worst[key] = max(worst.get(key, 0.0), row["loss_error"], row["grad_error"])
    return {"topk_cases": len(topk), "topk_failures": losses.failures(topk), "worst_normalised": worst,
            "hidden_cases": len(hidden["cases"]), "hidden_failures": hidden_losses.failures(hidden),
            "fused_worst_relative": max(fused.values()), "fused_failures": [k for k, v in fused.items() if not v <= 1e-4]}


def loss_speed_body(num_tokens: int, vocab: int, real_vocab: int, k: int, repeats: int) -> dict:
    from megatron_gkd import platform
    from megatron_gkd.losses import vocab_parallel_distill_loss
    from megatron_gkd.losses.reference import reference_distill_loss

    device = platform.device()
    generator = torch.Generator(device=device).manual_seed(0)
    logits = 2 * torch.randn(num_tokens, vocab, device=device, generator=generator)
    logits[:, real_vocab:] += 8.0  # padding rows hold the largest logits: mass left on them shows
    noise = 1.5 * torch.randn(num_tokens, real_vocab, device=device, generator=generator)
    teacher_logprobs, teacher_ids = torch.log_softmax(logits[:, :real_vocab] + noise, -1).topk(k, dim=-1)
    del noise
    upstream = torch.randn(num_tokens, device=device, generator=generator)
    rows, errors = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype).requires_grad_()
        grad_floor = torch.randn_like(x, dtype=torch.float32)

        def floor():
            torch.log_softmax(x, dim=-1, dtype=torch.float32).backward(grad_floor)
            x.grad = None

        floor_row = {"loss": "floor: fp32 log_softmax fwd+bwd", "dtype": str(dtype), **_timed(floor, repeats)}
        rows.append(floor_row)
        for loss_type, options in LOSS_CONFIGS:
            name = loss_type + (f" {options}" if options else "")

            def ours():
                loss, _ = vocab_parallel_distill_loss(x, teacher_ids, teacher_logprobs, loss_type=loss_type,
                                                      tp_group=None, real_vocab_size=real_vocab, **options)
                (loss * upstream).sum().backward()
                x.grad = None

            row = {"loss": name, "dtype": str(dtype), **_timed(ours, repeats)}
            row["x_floor_ms"] = _ratio(row["ms"], floor_row["ms"])
            row["x_floor_mib"] = _ratio(row["peak_mib"], floor_row["peak_mib"])
            if dtype == torch.float32:
                def naive():
                    loss = reference_distill_loss(x, teacher_ids, teacher_logprobs, loss_type, dtype=torch.float32,
                                                  real_vocab_size=real_vocab, **options)
                    (loss * upstream).sum().backward()
                    x.grad = None

                naive_row = _timed(naive, max(1, repeats // 2))
                row["naive_ms"], row["naive_peak_mib"] = naive_row["ms"], naive_row["peak_mib"]
                # Exactness at the real size: ours against float64 on the same (fp32) logits.
                loss, _ = vocab_parallel_distill_loss(x, teacher_ids, teacher_logprobs, loss_type=loss_type,
                                                      tp_group=None, real_vocab_size=real_vocab, **options)
                (loss.double() * upstream).sum().backward()
                grad, x.grad = x.grad, None
                full = x.detach().double().requires_grad_()
                expected = reference_distill_loss(full, teacher_ids, teacher_logprobs, loss_type,
                                                  real_vocab_size=real_vocab, **options)
                (expected * upstream).sum().backward()
                errors[name] = {
                    "loss_rel": ((loss.double() - expected).abs().max() / expected.abs().max()).item(),
                    "grad_rel": ((grad.double() - full.grad).abs().max() / full.grad.abs().max()).item(),
                    "padding_grad_max": grad[:, real_vocab:].abs().max().item(),
                }
                del full, expected, grad
            rows.append(row)
    return {"rows": rows, "errors_fp32_vs_fp64": errors}


def fused_body(num_tokens: int, vocab: int, hidden_size: int, k: int, chunk_size: int, repeats: int) -> dict:
    from megatron_gkd import platform
    from megatron_gkd.losses import fused_vocab_parallel_distill_loss, vocab_parallel_distill_loss

    device = platform.device()
    generator = torch.Generator(device=device).manual_seed(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(num_tokens, hidden_size, device=device, generator=generator).to(dtype).requires_grad_()
        weight = (torch.randn(vocab, hidden_size, device=device, generator=generator) / hidden_size**0.5).to(dtype)
        weight.requires_grad_()
        with torch.no_grad():
            teacher_logprobs, teacher_ids = torch.log_softmax((hidden @ weight.t()).float(), -1).topk(k, dim=-1)

        def unfused():
            loss, _ = vocab_parallel_distill_loss(hidden @ weight.t(), teacher_ids, teacher_logprobs,
                                                  loss_type="forward_kl", tp_group=None)
            loss.sum().backward()
            hidden.grad = weight.grad = None

        def fused():
            loss, _ = fused_vocab_parallel_distill_loss(hidden, weight, teacher_ids, teacher_logprobs,
                                                        loss_type="forward_kl", tp_group=None, chunk_size=chunk_size)
            loss.sum().backward()
            hidden.grad = weight.grad = None

        base = {"variant": "unfused: output layer + forward_kl", "dtype": str(dtype), **_timed(unfused, repeats)}
        row = {"variant": f"fused (chunk {chunk_size})", "dtype": str(dtype), **_timed(fused, repeats)}
        row["x_unfused_ms"], row["x_unfused_mib"] = _ratio(row["ms"], base["ms"]), _ratio(row["peak_mib"], base["peak_mib"])
        rows += [base, row]
    return {"rows": rows}


def nccl_pair_body() -> dict:
    """Rank body without a default group: ranks 0 and 1 both on device 0, one broadcast."""
    import datetime

    import torch.distributed as dist

    from megatron_gkd import platform

    platform.set_local_device(0)
    dist.init_process_group(platform.dist_backend(), timeout=datetime.timedelta(seconds=60))
    tensor = torch.full((4,), float(dist.get_rank()), device=platform.device())
    dist.broadcast(tensor, src=0)
    platform.synchronize()
    value = tensor.tolist()
    dist.destroy_process_group()
    return {"received": value}


def _trainer_runs(assets: pathlib.Path, out: pathlib.Path, platform_name: str) -> dict:
    from megatron_gkd.testing import runs as harness

    found = {}
    for dtype in ("float32", "bfloat16") if platform_name != "cpu" else ("float32",):
        run_dir = out / f"trainer-{platform_name}-{dtype}"
        overrides = (harness.asset_overrides(assets) + harness.OFF_POLICY_3_STEPS + TRAINER_STEPS
                     + [f"student.dtype={dtype}"])
        for deterministic in ("true", "false"):  # the second only if the first fails (a finding on its own)
            start = time.perf_counter()
            process = harness.start(run_dir.with_name(f"{run_dir.name}-det-{deterministic}"),
                                    overrides + [f"trainer.deterministic={deterministic}"], nproc=1,
                                    env={"MEGATRON_GKD_PLATFORM": platform_name})
            code = harness.wait(process, timeout_s=600)
            log = process.log_path.read_text(errors="replace")
            steps = harness.steps(run_dir.with_name(f"{run_dir.name}-det-{deterministic}")) if code == 0 else []
            found[dtype if deterministic == "true" else f"{dtype}-not-deterministic"] = {
                "exit": code, "seconds": time.perf_counter() - start, "losses": [r["train/loss"] for r in steps],
                "grad_norms": [r["train/grad_norm"] for r in steps], "log_tail": log[-3000:] if code else ""}
            if code == 0:
                break
    return found


def trainer_part(args) -> dict:
    platform_name = args.platform
    found = _trainer_runs(pathlib.Path(args.assets).resolve(), pathlib.Path(args.out).resolve(), platform_name)
    if platform_name == "cpu":
        return found
    def finished(dtype):  # the deterministic run, or the other where it failed
        return next((found[key] for key in (dtype, f"{dtype}-not-deterministic")
                     if key in found and found[key]["losses"]), None)

    fp32, bf16 = finished("float32"), finished("bfloat16")
    if fp32 and bf16:
        found["bf16_vs_fp32_max_abs"] = max(abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"]))
    if args.cpu_reference and fp32:
        host = json.loads(pathlib.Path(args.cpu_reference).read_text())["trainer"]["float32"]
        found["device_vs_cpu_loss_max_abs"] = max(abs(a - b) for a, b in zip(fp32["losses"], host["losses"]))
        found["device_vs_cpu_grad_norm_max_rel"] = max(
            abs(a - b) / abs(b) for a, b in zip(fp32["grad_norms"], host["grad_norms"]))
    return found


def run_parts(args) -> dict:
    results: dict = {}
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    for part in args.parts:
        start = time.perf_counter()
        print(f"== {part}", flush=True)
        try:
            if part == "env":
                results[part] = run_distributed(env_body, 1, platform_name=args.platform, init_process_group=False)[0]
            elif part == "parity":
                results[part] = _parity(args, tokens)
            elif part == "losses":
                results[part] = run_distributed(losses_body, 1, platform_name=args.platform, timeout=1200)[0]
            elif part == "loss_speed":
                results[part] = run_distributed(loss_speed_body, 1, platform_name=args.platform, timeout=1200, args=(
                    args.num_tokens, args.vocab, args.vocab - 267, 64, args.repeats))[0]
            elif part == "fused":
                results[part] = run_distributed(fused_body, 1, platform_name=args.platform, timeout=1200, args=(
                    args.fused_tokens, args.vocab, args.hidden_size, 64, args.chunk_size, args.repeats))[0]
            elif part == "trainer":
                results[part] = trainer_part(args)
            elif part == "two_ranks_one_device":
                results[part] = run_distributed(nccl_pair_body, 2, platform_name=args.platform, init_process_group=False,
                                                timeout=120)
            else:
                raise ValueError(f"unknown part {part!r}")
        except Exception:  # noqa: BLE001 - one part's failure is a finding; the others still run
            results[part] = {"error": traceback.format_exc()[-4000:]}
        results.setdefault("seconds", {})[part] = time.perf_counter() - start
        print(json.dumps(results[part], indent=1, default=str)[:6000], flush=True)
        pathlib.Path(args.json or pathlib.Path(args.out, "accelerator_path.json")).write_text(
            json.dumps(results, indent=1, default=str))
    return results


def _parity(args, tokens) -> dict:
    from megatron_gkd.testing.hf_models import hf_logits, make_tiny_checkpoint

    checkpoints = {arch: make_tiny_checkpoint(arch, pathlib.Path(args.out) / "parity" / arch)
                   for arch in PARITY_ARCHITECTURES}
    found = run_distributed(parity_body, 1, platform_name=args.platform, args=(checkpoints, tokens), timeout=600)[0]
    report = {}
    for arch, path in checkpoints.items():
        expected, got = hf_logits(path, tokens), found[arch]["logits"]
        report[arch] = {"device": found[arch]["device"],
                        "max_rel": ((got - expected).abs().max() / expected.abs().max()).item()}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--platform", default=None, choices=PLATFORM_NAMES,
                        help="default: what is present; cpu: try the script out on the host at small sizes, or "
                             "write --cpu-reference")
    parser.add_argument("--parts", nargs="+",
                        default=["env", "parity", "losses", "loss_speed", "fused", "trainer", "two_ranks_one_device"])
    parser.add_argument("--assets", default=str(REPO / "outputs" / "tiny_assets"),
                        help="tiny assets (python -m megatron_gkd.recipes.tiny) for the trainer part")
    parser.add_argument("--json", default=None, help="where the figures go (default: OUT/accelerator_path.json)")
    parser.add_argument("--cpu-reference", default=None,
                        help="accelerator_path.json of `--platform cpu --parts trainer` run on a CPU")
    parser.add_argument("--vocab", type=int, default=151936, help="rows of the table (the last 267 are padding)")
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--fused-tokens", type=int, default=16384)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    args.platform = args.platform or detect()
    os.makedirs(args.out, exist_ok=True)
    run_parts(args)


if __name__ == "__main__":
    sys.exit(main())

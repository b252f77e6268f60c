"""The loop's speed against TRL's at several scales (issue #32 item 1): the same on-policy distillation task,
run by TRL's ``DistillationTrainer`` and by ``torchrun launch/pretrain_gkd.py``, one after the other::

    python benchmarks/trl_compare.py                                  # every shape and length (hours at 0.6b)
    python benchmarks/trl_compare.py --shapes tiny --lengths 24       # the issue's first measurement, minutes
    python benchmarks/trl_compare.py --report                         # the table again from what finished

The task: random Qwen3 student and teacher of one shape sharing a word-level tokenizer, prompts of 3-12 random
words, ``--batch`` prompts a step with one sample each, responses sampled at T=1 up to ``--lengths`` tokens
(a random model ends one early when it samples the end-of-sequence id, on either side), forward KL over the
whole vocabulary, a constant learning rate, ``--steps`` steps. Shapes:

=========  ===========================================================  ==========================
``tiny``   student 1 layer x 128, teacher 2 layers x 128, vocab 256     the issue's measurement
``0.1b``   student 12 layers x 768, teacher 12 layers x 1024, vocab 32k  ~0.1B / ~0.2B parameters
``0.6b``   Qwen3-0.6B's shape for both (28 x 1024, vocab 151,936)       0.6B each, random weights
=========  ===========================================================  ==========================

Each system in its best configuration for 2 cores: TRL in one process with 2 threads and HF ``generate`` (its
CPU path; its vLLM path needs a GPU); ours with the layout chosen per shape (``OURS``: one rank on one thread with the
``hf`` rollout engine at the tiny shape, the teacher service on the other core, where TP=2 only adds communication
and vLLM's per-step bookkeeping dominates the decode; one rank with 2 threads, the ``hf`` engine and the ``sync``
scheduler at 0.1b and 0.6b, where the phases take both cores in turn, and at 0.6b the only layout of ours that fits in
24 GiB), the teacher served on loopback, the teacher's whole distribution (its final hidden states, from which the
rank computes its logits over the whole vocabulary: top-k over the whole vocabulary would be gigabytes a step on the
wire at 32k+ ids, and its sparse bookkeeping costs more than the dense row at 256).

TRL runs in its own virtualenv (``--trl-venv``, created on first use: ``pip install torch==2.13.0
trl==1.16.0``, about a minute), never a dependency of the project. Figures per run: median step time over the
steps after ``--skip``, start-up (process start to the first step), start-up and first step together (TRL loads its
weights lazily, in its first step: :func:`first_step_end`), the whole command, peak RSS per process,
and our per-phase medians (``time/*``). Timed on a quiet machine only: two runs never share the cores.
Results: ``<out>/results.json`` and a Markdown table (``<out>/results.md``) for docs/performance.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

from megatron_gkd.recipes import tiny
from megatron_gkd.testing import runs as harness

logger = logging.getLogger("trl_compare")

ROOT = harness.REPO
SHAPES = {
    "tiny": dict(vocab_size=256,
                 student=dict(hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=256),
                 teacher=dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=256)),
    "0.1b": dict(vocab_size=32_000,
                 student=dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048),
                 teacher=dict(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=8, intermediate_size=3072)),
    "0.6b": dict(vocab_size=151_936,
                 student=dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=3072),
                 teacher=dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=3072)),
}
# Our layout per shape (the best found for 2 cores; see docs/performance.md): ranks, threads per rank, the tensor-parallel
# size of the student and of each rollout replica, and the options (the teacher's signal, the engine, the scheduler).
Layout = collections.namedtuple("Layout", "nproc threads tp options")
OURS = {
    # One rank on one thread: the teacher service scores the next batch on the other core (one_step_off), and no
    # gradient all-reduce or second engine. At 24 tokens two ranks measured 1.54-1.59x TRL's step against 1.31-1.32x,
    # one rank on 2 threads 1.5x (sync) and 13x (one_step_off: the rank's and the teacher's threads oversubscribe the
    # 2 cores); at 256 tokens two ranks are ahead (1.06-1.12x against 1.13-1.15x): --ours-nproc 2.
    # The teacher sends its final hidden states (float32, as exact as TRL's in-process teacher) and the rank computes its
    # full-vocabulary logits: at 24 tokens 0.062 s a step against 0.071 s with the top-256 log-probs, whose sparse
    # support machinery costs more than the dense 256-wide row it describes.
    "tiny": Layout(1, 1, 1, ["teacher.signal=hidden", "teacher.hidden_dtype=float32", "rollout.engine=hf",
                             "rollout.kv_cache_memory_mb=null"]),
    # One rank with both cores, as at 0.6b: 1.14x TRL's step at 24 tokens against 1.28x at TP=2 with vLLM (whose weight
    # sync alone took 1.8 s a step); at 256 tokens vLLM's decode wins (--ours-nproc 2 --ours-tp 2 and the engine).
    "0.1b": Layout(1, 2, 1, ["teacher.signal=hidden", "rollout.engine=hf", "rollout.kv_cache_memory_mb=null",
                             "trainer.scheduler=sync"]),
    # One rank with both cores: two ranks at TP=2 each hold the fp32 student, its Adam state and an engine shard, over
    # this machine's 24 GiB; sync, as the teacher scoring beside the update would take cores from it.
    "0.6b": Layout(1, 2, 1, ["teacher.signal=hidden", "rollout.engine=hf", "rollout.kv_cache_memory_mb=null",
                             "trainer.scheduler=sync"]),
}
PHASES = ("rollout", "teacher_wait", "train", "weight_sync")


def build_assets(root: pathlib.Path, shape: str, num_prompts: int) -> pathlib.Path:
    """Student, teacher (each with the tokenizer) and prompts of ``shape`` under ``root/shape`` (once)."""
    out = root / "assets" / shape
    if (out / "READY").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    spec = SHAPES[shape]
    for name, seed in (("student", 2), ("teacher", 1)):
        tiny.build_checkpoint(out / name, vocab_size=spec["vocab_size"], seed=seed, **spec[name])
        tiny.build_tokenizer(out / name, spec["vocab_size"])
    tiny.write_prompts(out / "train.jsonl", num_prompts, vocab_size=spec["vocab_size"], seed=3)
    tiny.write_prompts(out / "eval.jsonl", 16, vocab_size=spec["vocab_size"], seed=4)
    (out / "READY").write_text(shape + "\n")
    return out


def trl_python(venv: pathlib.Path) -> pathlib.Path:
    """TRL's interpreter, its virtualenv created on first use."""
    python = venv / "bin" / "python"
    if not (venv / "READY").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "trl==1.16.0"], check=True)
        (venv / "READY").write_text("torch==2.13.0 trl==1.16.0\n")
    return python


def run_trl(python: pathlib.Path, assets: pathlib.Path, out: pathlib.Path, args, length: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.json"
    command = [str(python), str(ROOT / "benchmarks" / "trl_side.py"), "--student", str(assets / "student"),
               "--teacher", str(assets / "teacher"), "--prompts", str(assets / "train.jsonl"), "--steps", str(args.steps),
               "--batch", str(args.batch), "--max-tokens", str(length), "--lr", str(args.lr), "--out", str(out / "trl"),
               "--result", str(result)]
    began = time.perf_counter()
    with open(out / "run.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "2"})
    record = json.loads(result.read_text())
    record["command_s"] = time.perf_counter() - began
    return record


def run_ours(assets: pathlib.Path, out: pathlib.Path, args, shape: str, length: int) -> dict:
    layout = OURS[shape]
    nproc, tp = args.ours_nproc or layout.nproc, args.ours_tp or layout.tp  # a micro-batch a step per data-parallel rank
    threads = args.ours_threads or (layout.threads if nproc == layout.nproc else 2 // nproc)
    overrides = [f"student.checkpoint={assets / 'student'}", f"teacher.serve.model={assets / 'teacher'}",
                 f"data.train_path={assets / 'train.jsonl'}", f"data.eval_path={assets / 'eval.jsonl'}",
                 f"trainer.num_steps={args.steps}", f"trainer.global_batch_size={args.batch}",
                 f"parallel.tensor_model_parallel_size={tp}", f"rollout.tensor_parallel_size={tp}",
                 f"trainer.micro_batch_size={args.batch * tp // nproc}", "rollout.n=1", f"rollout.max_tokens={length}",
                 f"rollout.max_model_len={length + 64}", f"optim.lr={args.lr}", "optim.lr_warmup_steps=0",
                 "eval.at_start=false", "eval.at_end=false", "eval.interval=null", "checkpoint.save_interval=null",
                 "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false", *layout.options, *args.ours_override]
    began = time.perf_counter()
    code, log = harness.run(out, overrides, nproc=nproc, timeout_s=args.timeout_s,
                            env={"OMP_NUM_THREADS": str(threads)})
    command_s = time.perf_counter() - began
    if code:
        raise RuntimeError(f"our run in {out} failed ({code}):\n{log[-3000:]}")
    records = harness.metrics(out)
    steps = [r for r in records if "time/step" in r]
    startup = next(r["time/startup/total"] for r in records if "time/startup/total" in r)
    marker = "megatron-gkd summary: "  # the entry point's one-line summary, for scripts
    summary = json.loads(next(line for line in log.splitlines() if line.startswith(marker))[len(marker):])
    # The teacher service's own line as it stops (TRL's one process holds its teacher; ours is beside the ranks, unless
    # it is on them: teacher.client=local starts no service).
    service_log = out / "teacher_service.log"
    stopped = re.findall(r"teacher serve stopped: peak RSS ([0-9.]+) GiB",
                         service_log.read_text() if service_log.exists() else "")
    return {"system": "ours", "steps": len(steps), "step_times": [r["time/step"] for r in steps],
            "phases": {p: [r.get(f"time/{p}", 0.0) for r in steps] for p in PHASES}, "startup_s": startup,
            "command_s": command_s, "peak_rss_gib": summary.get("peak_rss_gib_per_rank"),
            "teacher_rss_gib": float(stopped[-1]) if stopped else None,
            "losses": [r["train/loss"] for r in steps if "train/loss" in r]}


def median_after(times: list[float], skip: int) -> float:
    kept = times[skip:] or times
    return statistics.median(kept)


def first_step_end(run: dict) -> float:
    """Seconds from the process's start to the end of its first step. TRL's start-up alone is not ours: transformers
    (5.x) maps both checkpoints and reads a weight when the first step touches it, and torch allocates the gradients in
    the first backward, so TRL's first step carries the loads that ours does before it (docs/performance.md)."""
    return run["startup_s"] + run["step_times"][0]


def markdown(results: dict, skip: int) -> str:
    lines = ["| shape | response tokens | system | step s (median) | ours / TRL | start-up s | start-up + first step s | "
             "whole command s | peak RSS GiB | our phases: rollout / teacher wait / train / weight sync s |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for key, pair in sorted(results.items()):
        shape, length = key.split("/")
        trl_step = median_after(pair["trl"]["step_times"], skip) if "trl" in pair else None
        for system in ("trl", "ours"):
            if system not in pair:
                continue
            run = pair[system]
            step = median_after(run["step_times"], skip)
            ratio = f"{step / trl_step:.2f}" if system == "ours" and trl_step else ""
            phases = (" / ".join(f"{median_after(run['phases'][p], skip):.3f}" for p in PHASES)
                      if system == "ours" else "")
            rss, teacher = run.get("peak_rss_gib"), run.get("teacher_rss_gib")
            rss_text = (f"{max(rss):.2f} (max of ranks)" if isinstance(rss, list) else f"{rss:.2f}") if rss else "n/a"
            rss_text += f" + teacher {teacher:.2f}" if teacher else ""
            lines.append(f"| {shape} | {length} | {system} | {step:.3f} | {ratio} | {run['startup_s']:.1f} | "
                         f"{first_step_end(run):.1f} | {run['command_s']:.1f} | {rss_text} | {phases} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--lengths", nargs="+", type=int, default=[24, 256])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the medians")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--systems", nargs="+", default=["trl", "ours"], choices=["trl", "ours"])
    parser.add_argument("--out", default="outputs/trl_compare")
    parser.add_argument("--trl-venv", default="outputs/trl_venv")
    parser.add_argument("--timeout-s", type=float, default=7200)
    parser.add_argument("--ours-override", nargs="*", default=[],
                        help="more config overrides for our runs (e.g. memory settings at the 0.6b shape)")
    parser.add_argument("--ours-nproc", type=int, choices=[1, 2], help="our ranks (default: the shape's in OURS)")
    parser.add_argument("--ours-tp", type=int, choices=[1, 2], help="our tensor-parallel size (default: OURS)")
    parser.add_argument("--ours-threads", type=int, help="threads of each of our ranks (default: OURS, or 2 / ranks)")
    parser.add_argument("--report", action="store_true", help="only tabulate what has finished")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    root = pathlib.Path(args.out).resolve()
    for shape in args.shapes if not args.report else ():
        assets = build_assets(root, shape, args.steps * args.batch)
        for length in args.lengths:
            for system in args.systems:
                out = root / "runs" / f"{shape}-{length}-{system}"
                if (out / "figures.json").exists():
                    continue
                logger.info("%s, %d tokens: %s", shape, length, system)
                record = (run_trl(trl_python(pathlib.Path(args.trl_venv).resolve()), assets, out, args, length)
                          if system == "trl" else run_ours(assets, out, args, shape, length))
                (out / "figures.json").write_text(json.dumps(record) + "\n")
                logger.info("%s: median step %.3f s, start-up %.1f s, whole %.1f s", system,
                            median_after(record["step_times"], args.skip), record["startup_s"], record["command_s"])
    results: dict = {}
    for path in sorted((root / "runs").glob("*/figures.json")):
        shape, length, system = path.parent.name.split("-")
        results.setdefault(f"{shape}/{length}", {})[system] = json.loads(path.read_text())
    table = markdown(results, args.skip)
    (root / "results.json").write_text(json.dumps(results) + "\n")
    (root / "results.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

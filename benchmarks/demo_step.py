"""Step time of the distillation demo (``configs/demo_cpu.yaml``) in its rollout and micro-batch layouts.

    python benchmarks/demo_step.py                  # 60 steps of each layout, back to back
    python benchmarks/demo_step.py --steps 100 --layouts tp2_engine replicas_one_microbatch

Each run is the demo's own command (the real entry point under torchrun, 2 ranks, the committed student and
teacher, the teacher service the run starts) on the demo's task files, with eval, checkpoints and the HF
export off. Step time is the median of ``time/step`` (wall time between two steps' ends) over the steps
after the warm-up, with the median of each phase; ratios are against the first layout measured in the same
invocation (the step time on this machine drifts by tens of percent over an hour, so only ratios from one
invocation compare). ``loss`` is the last step's: the layouts sample the same tokens (vLLM replicas draw
with the seeds one engine would use), so it differs by float summation order only.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import statistics
import subprocess
import sys
import tempfile

from megatron_gkd.testing import runs as harness

logger = logging.getLogger(__name__)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"
LAYOUTS = {
    "tp2_engine": ["rollout.tensor_parallel_size=2", "trainer.micro_batch_size=32"],  # the demo until 2026-11-26
    "replicas": ["rollout.tensor_parallel_size=1", "trainer.micro_batch_size=32"],
    "replicas_one_microbatch": ["rollout.tensor_parallel_size=1", "trainer.micro_batch_size=64"],  # the demo now
    # More prompts a step (issue #30: less gradient noise), one micro-batch.
    **{f"prompts_{n}": ["rollout.tensor_parallel_size=1", f"trainer.global_batch_size={n}",
                        f"trainer.micro_batch_size={n}"] for n in (96, 128)},
}
PHASES = ("rollout", "train", "weight_sync", "teacher_wait", "batch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the medians")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench_demo_step_"))
    task = root / "task"
    subprocess.run([sys.executable, "-m", "megatron_gkd.recipes.arithmetic", "--out", str(task)], check=True, cwd=ROOT)
    common = [f"data.train_path={task / 'train.jsonl'}", f"data.eval_path={task / 'eval.jsonl'}",
              f"trainer.num_steps={args.steps}", "eval.at_start=false", "eval.at_end=false", "eval.interval=null",
              "checkpoint.save_interval=null", "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false",
              "logging.progress_bar=false"]
    rows = {}
    for layout in args.layouts:
        out = root / layout
        code, log = harness.run(out, common + LAYOUTS[layout], config=CONFIG)
        if code:
            raise SystemExit(f"{out} failed:\n{log[-3000:]}")
        steps = harness.steps(out)
        kept = steps[args.skip:]
        rows[layout] = {name: statistics.median(r[f"time/{name}"] for r in kept if f"time/{name}" in r)
                        for name in ("step", *PHASES)}
        rows[layout]["loss"] = steps[-1]["train/loss"]
        logger.info("%s: %.3f s/step", layout, rows[layout]["step"])
    base = rows[args.layouts[0]]["step"]
    print(f"demo config, median over steps {args.skip + 1}..{args.steps}; runs in {root}")
    print(f"{'layout':26s} {'step s':>7s} {'ratio':>6s} " + " ".join(f"{name:>12s}" for name in PHASES) + f" {'loss':>10s}")
    for layout, row in rows.items():
        print(f"{layout:26s} {row['step']:7.3f} {row['step'] / base:6.3f} "
              + " ".join(f"{row[name]:12.3f}" for name in PHASES) + f" {row['loss']:10.7f}")


if __name__ == "__main__":
    main()

"""Step time of each scheduler with a slow teacher: how much of the teacher's latency the off-policy
schedulers hide behind training.

    python benchmarks/schedulers.py                        # delay 0.4 s, both rollout layouts
    python benchmarks/schedulers.py --delay-s 0.4 1.0 --steps 14 --layouts colocated

Each run is the real entry point under torchrun on the tiny CPU assets (TP=2 student, vLLM rollout, the
teacher service the run starts) with ``teacher.serve.delay_s`` added to every teacher request (the
latency knob of ``launch/teacher_server.py --delay-s``). Step time is the median of ``time/step``
(wall time between two steps' ends) over the steps after the warm-up; the floor is the same schedule
with no delay (``sync``: what the teacher's own work costs without the knob). Ratios are against
``sync`` at the same delay, measured in the same invocation.

The delay is slept by the (single) teacher worker, so the teacher serves one request at a time: once its
latency exceeds the rest of the step (rollout + update + sync, about 0.4 s here) every scheduler is bound
by the teacher's throughput, and overlap can hide at most the rest of the step. The default delay is
about the rest of the step, where hiding the teacher pays most (at best 0.5x sync).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile

from megatron_gkd.testing import runs as harness

SCHEDULERS = ("sync", "one_step_off", "two_step_off")
LAYOUTS = {"colocated": [],
           "disaggregated": ["rollout.layout=disaggregated", "weight_sync.transport=distributed",
                             "rollout.tensor_parallel_size=1"]}


def step_time(out: pathlib.Path, skip: int) -> float:
    times = [record["time/step"] for record in harness.steps(out)][skip:]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-s", type=float, nargs="+", default=[0.4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the median")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    from megatron_gkd.recipes.tiny import build_assets

    root = pathlib.Path(tempfile.mkdtemp(prefix="bench_schedulers_"))
    assets = build_assets(root / "assets")
    common = harness.asset_overrides(assets) + [
        f"trainer.num_steps={args.steps}", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=null",
        "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false", "optim.lr_warmup_steps=0"]
    results = {}
    for layout in args.layouts:
        for delay in [0.0, *args.delay_s]:
            for scheduler in (SCHEDULERS if delay else ("sync",)):
                out = root / f"{layout}-{delay}-{scheduler}"
                code, log = harness.run(out, common + LAYOUTS[layout] + [
                    f"trainer.scheduler={scheduler}", f"teacher.serve.delay_s={delay}"])
                if code:
                    raise SystemExit(f"{out} failed:\n{log[-3000:]}")
                results[layout, delay, scheduler] = step_time(out, args.skip)
    print(f"median step time over steps {args.skip + 1}..{args.steps}; runs in {root}")
    print(f"{'layout':14s} {'delay s':>8s} {'scheduler':14s} {'step s':>8s} {'/ sync':>7s} {'/ floor':>8s}")
    for layout in args.layouts:
        floor = results[layout, 0.0, "sync"]
        for delay in [0.0, *args.delay_s]:
            for scheduler in (SCHEDULERS if delay else ("sync",)):
                value = results[layout, delay, scheduler]
                print(f"{layout:14s} {delay:8.2f} {scheduler:14s} {value:8.3f} "
                      f"{value / results[layout, delay, 'sync']:7.3f} {value / floor:8.3f}")


if __name__ == "__main__":
    main()

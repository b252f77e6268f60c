"""Step time of each scheduler with a slow teacher: how much of the teacher's latency the off-policy
schedulers hide behind training.

    python benchmarks/schedulers.py                        # delay 0.4 s, both rollout layouts
    python benchmarks/schedulers.py --delay-s 0.4 1.0 --steps 14 --layouts colocated
    python benchmarks/schedulers.py --delay-s 1.0 --layouts colocated --workers 1 2 --schedulers sync one_step_off

Each run is the real entry point under torchrun on the tiny CPU assets (TP=2 student, vLLM rollout, the
teacher service the run starts) with ``teacher.serve.delay_s`` added to every teacher request (the
latency knob of ``launch/teacher_server.py --delay-s``). Step time is the median of ``time/step``
(wall time between two steps' ends) over the steps after the warm-up; the floor is the same schedule
with no delay (``sync``: what the teacher's own work costs without the knob). Ratios are against
``sync`` at the same delay, measured in the same invocation. ``wait s`` is the median ``time/teacher_wait``:
the teacher's latency the step did not hide.

The delay is slept by each teacher worker, and a worker serves one request at a time: with one worker,
once the latency exceeds the rest of the step (rollout + update + sync, about 0.4 s here) every scheduler
is bound by the teacher's throughput, and overlap can hide at most the rest of the step. The default
delay is about the rest of the step, where hiding the teacher pays most (at best 0.5x sync).
``--workers`` runs the teacher as that many replicas (``teacher.serve.num_workers``): the off-policy
schedulers have the next steps' requests in flight while one is scored, so a second replica takes them
and the bound becomes ``(delay + rest of the step) / 2`` for ``one_step_off``. ``sync`` has one request
in flight and gains nothing from a replica (``teacher.split_requests`` would cut it, but a sleep-based
delay is per request, not per token, so here it cannot show what splitting saves).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import statistics
import tempfile

from megatron_gkd.testing import runs as harness

logger = logging.getLogger(__name__)

SCHEDULERS = ("sync", "one_step_off", "two_step_off")
LAYOUTS = {"colocated": [],
           "disaggregated": ["rollout.layout=disaggregated", "weight_sync.transport=distributed",
                             "rollout.tensor_parallel_size=1"]}


def step_time(out: pathlib.Path, skip: int, timer: str = "time/step") -> float:
    """Median of ``timer`` over the steps after ``skip``."""
    return statistics.median([record[timer] for record in harness.steps(out)][skip:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-s", type=float, nargs="+", default=[0.4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the median")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--workers", type=int, nargs="+", default=[1],
                        help="teacher replicas (teacher.serve.num_workers) of the delayed runs")
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULERS), choices=SCHEDULERS,
                        help="schedulers of the delayed runs (sync is always run: the ratios need it)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    schedulers = ["sync", *[name for name in args.schedulers if name != "sync"]]
    # (delay, workers) of each group of runs; the floor (no delay, sync) needs one worker only.
    settings = [(0.0, 1)] + [(delay, workers) for delay in args.delay_s for workers in args.workers]
    from megatron_gkd.recipes.tiny import build_assets

    root = pathlib.Path(tempfile.mkdtemp(prefix="bench_schedulers_"))
    assets = build_assets(root / "assets")
    common = harness.asset_overrides(assets) + [
        f"trainer.num_steps={args.steps}", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=null",
        "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false", "optim.lr_warmup_steps=0"]
    results, waits = {}, {}
    for layout in args.layouts:
        for delay, workers in settings:
            for scheduler in (schedulers if delay else ("sync",)):
                out = root / f"{layout}-{delay}-w{workers}-{scheduler}"
                code, log = harness.run(out, common + LAYOUTS[layout] + [
                    f"trainer.scheduler={scheduler}", f"teacher.serve.delay_s={delay}",
                    f"teacher.serve.num_workers={workers}"])
                if code:
                    raise SystemExit(f"{out} failed:\n{log[-3000:]}")
                results[layout, delay, workers, scheduler] = step_time(out, args.skip)
                # The part of the step spent waiting for the teacher: what replicas can shorten, and less
                # sensitive than the step to other load on the machine.
                waits[layout, delay, workers, scheduler] = step_time(out, args.skip, "time/teacher_wait")
                logger.info("%s: %.3f s/step", out.name, results[layout, delay, workers, scheduler])
    print(f"median step time over steps {args.skip + 1}..{args.steps}; runs in {root}")
    print(f"{'layout':14s} {'delay s':>8s} {'workers':>7s} {'scheduler':14s} {'step s':>8s} {'/ sync':>7s} "
          f"{'/ floor':>8s} {'wait s':>7s}")
    for layout in args.layouts:
        floor = results[layout, 0.0, 1, "sync"]
        for delay, workers in settings:
            for scheduler in (schedulers if delay else ("sync",)):
                value = results[layout, delay, workers, scheduler]
                print(f"{layout:14s} {delay:8.2f} {workers:7d} {scheduler:14s} {value:8.3f} "
                      f"{value / results[layout, delay, workers, 'sync']:7.3f} {value / floor:8.3f} "
                      f"{waits[layout, delay, workers, scheduler]:7.3f}")


if __name__ == "__main__":
    main()

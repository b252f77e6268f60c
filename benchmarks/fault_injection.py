"""Fault injection: a long run that loses a random part every few steps, against the same run without faults.

    python benchmarks/fault_injection.py                     # 40 steps, a kill every 5, seed 0
    python benchmarks/fault_injection.py --steps 60 --every 4 --seed 1 --parts rollout_server teacher_service

The run is the real entry point under torchrun (``megatron_gkd.testing.runs``, with torchrun's restarts as the
launcher sets them) on the tiny CPU assets: a TP=2 student, ``sync``, seeded sampling, deterministic, a rollout server
(``rollout.layout=disaggregated``, vLLM), a teacher service of two replicas, a checkpoint every 8 steps (so that kills
land between checkpoints). Every ``--every`` steps (counted by the highest step logged) one part, chosen at random, gets SIGKILL
(:mod:`megatron_gkd.testing.faults`):

- ``trainer_rank``: torchrun restarts every rank; the run resumes at its last checkpoint (steps after it are trained
  again: the steps lost);
- ``rollout_server``: the trainer starts a new one with the current weights and asks again what it had not answered;
- ``teacher_replica``: the service's proxy gives the dead replica's request back to the client, which retries it on
  the other (a replica is not restarted; when the last one dies the service exits: a ``teacher_service`` fault);
- ``teacher_service``: the trainer starts a new one on the same address; the clients' next attempt reaches it
  (``teacher.attempt_timeout_s`` is 10 s here, 60 s by default: the time a kill costs).

Reported: each kill's part and step; whether the run ended, every step logged once; samples trained twice and samples
lost (the final metrics' prompts against the run without faults: the goal is 0 and 0); whether every step's loss is
the fault-free run's (the run is deterministic, so a fault that loses or repeats nothing leaves the losses bitwise
equal); each kill's time lost (from the kill to the first step past the highest one logged before it, less one
fault-free step) and the whole run's overhead.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys
import tempfile
import time

from megatron_gkd.recipes.tiny import build_assets
from megatron_gkd.testing import faults
from megatron_gkd.testing import runs as harness

RUN = ["rollout.layout=disaggregated", "weight_sync.transport=distributed", "rollout.tensor_parallel_size=1",
       "trainer.scheduler=sync", "rollout.seed=7", "trainer.deterministic=true", "teacher.serve.num_workers=2",
       "teacher.attempt_timeout_s=10", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=8",
       "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false"]


def _timed_run(out: pathlib.Path, overrides: list[str], injector_args: dict | None, timeout_s: float):
    process = harness.start(out, overrides, log_name="run.log", max_restarts=20 if injector_args else 0)
    start = time.monotonic()
    injector = None
    if injector_args:
        injector = faults.FaultInjector(process, out, **injector_args)
        code = injector.run(timeout_s)
    else:
        code = harness.wait(process, timeout_s)
    return code, time.monotonic() - start, process.log_path.read_text(errors="replace"), injector


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="steps between two kills")
    parser.add_argument("--seed", type=int, default=0, help="of the parts chosen")
    parser.add_argument("--parts", nargs="+", default=list(faults.PARTS), choices=list(faults.PARTS))
    parser.add_argument("--cycle", action="store_true", help="kill the parts in the order given instead of at random")
    parser.add_argument("--work-dir", type=pathlib.Path, default=None)
    parser.add_argument("--timeout-s", type=float, default=3600)
    args = parser.parse_args(argv)

    work = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="fault_injection_"))
    assets = build_assets(work / "assets")
    overrides = harness.asset_overrides(assets) + RUN + [f"trainer.num_steps={args.steps}"]

    code, clean_s, log, _ = _timed_run(work / "clean", overrides, None, args.timeout_s)
    assert code == 0, log[-4000:]
    clean = harness.steps(work / "clean")
    step_s = statistics.median(r["time/step"] for r in clean[1:])

    code, faulty_s, log, injector = _timed_run(
        work / "faulty", overrides, dict(every=args.every, parts=args.parts, seed=args.seed, num_steps=args.steps,
                                          cycle=args.cycle), args.timeout_s)
    got = harness.steps(work / "faulty")
    trained = collections.Counter(p for r in got for p in r["prompts"])
    expected = collections.Counter(p for r in clean for p in r["prompts"])
    kills = [{"part": k.part, "step": k.step, "steps_trained_again": k.steps_trained_again,
              "time_lost_s": None if k.recovered_at is None else round(k.recovered_at - k.at - step_s, 1)}
             for k in injector.kills]
    report = {
        "command": " ".join(["python benchmarks/fault_injection.py", *(sys.argv[1:] if argv is None else argv)]),
        "steps": args.steps, "every": args.every, "seed": args.seed, "exit_code": code,
        "kills": kills, "kills_survived": len(injector.kills) if code == 0 and len(got) == args.steps else 0,
        "steps_logged_once": [r["step"] for r in got] == list(range(1, args.steps + 1)),
        "samples_trained_twice": sum(max(0, trained[p] - expected[p]) for p in trained),
        "samples_lost": sum(max(0, expected[p] - trained[p]) for p in expected),
        "losses_equal_fault_free": [r["train/loss"] for r in got] == [r["train/loss"] for r in clean],
        "restarts_of_the_ranks": sum(k.resumed_from is not None for k in injector.kills),
        "steps_trained_again": sum(k.steps_trained_again for k in injector.kills),
        "fault_free_s": round(clean_s, 1), "faulty_s": round(faulty_s, 1), "step_s": round(step_s, 2),
        "overhead_s_per_kill": round((faulty_s - clean_s) / max(1, len(injector.kills)), 1),
    }
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

"""Partial rollouts against ``one_step_off`` on a task of skewed response lengths, in one invocation: generated
tokens per second of rollout, trained tokens per second of wall time, and the staleness partial rollouts pay.

    python benchmarks/partial_rollouts.py                 # partial and partial_one_step_off, chunks of 32 tokens
    python benchmarks/partial_rollouts.py --chunk-tokens 16 32 --steps 16 --max-tokens 256 --repeats 2

Each run is the real entry point under torchrun on the tiny CPU assets (TP=2 student, colocated vLLM TP=2, the
teacher service the run starts, on-policy forward KL) with ``harness.SKEWED_LENGTHS`` (temperature 0.5 and 32 ids
that stop a response: most responses are short, median about 12 tokens, and a few run to ``rollout.max_tokens``).
``one_step_off`` samples each step's batch to its end, so its rollout lasts as long as the longest response;
``partial`` gives every sample at most ``--chunk-tokens`` new tokens a round and carries the unfinished ones to the
next step (:mod:`megatron_gkd.trainer.partial`); ``partial_one_step_off`` does so one update ahead (the teacher then
scores a batch while the previous update runs, as with ``one_step_off``).

Figures, over the steps after ``--skip``:
- ``gen tok/s``: tokens generated / seconds of ``time/rollout`` (one_step_off: the sampled batches' tokens;
  partial: every token its rounds generated, ``rollout/partial/generated_tokens``, trained this step or carried);
- ``trained tok/s``: response tokens trained / wall time (``time/step``): what the run gains end to end;
- ``rollout s``: median ``time/rollout`` a step; ``longest`` / ``mean len``: the longest and the mean response trained,
  averaged over steps;
- partial only: token staleness (mean of ``rollout/partial/token_staleness_mean``, max of ``..._max``), samples
  carried and rounds a step.
Ratios are against ``one_step_off`` of the same repeat, measured in the same invocation; the machine may be shared
(the load of others moves a run's figures by up to 2x), so read the ratios, over several ``--repeats``.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import statistics
import tempfile

from megatron_gkd.config.partial import PARTIAL_SCHEDULERS
from megatron_gkd.testing import runs as harness

logger = logging.getLogger(__name__)


def summary(out: pathlib.Path, skip: int, ahead: bool) -> dict:
    """The figures of one run (see the module docstring; ``ahead``: its scheduler samples one update ahead)."""
    steps = harness.steps(out)[skip:]
    key = "rollout/partial/generated_tokens" if "rollout/partial/rounds" in steps[0] else "rollout/num_tokens"
    if ahead:  # a step's record times the rollout of the next batch (the last step samples none)
        generated = sum(r[key] for r in steps[1:])
        rollout_s = sum(r["time/rollout"] for r in steps[:-1])
    else:  # a step's record holds its own rollout and the tokens it generated
        generated = sum(r[key] for r in steps)
        rollout_s = sum(r["time/rollout"] for r in steps)
    figures = {"gen_tok_s": generated / rollout_s,
               "trained_tok_s": sum(r["rollout/num_tokens"] for r in steps) / sum(r["time/step"] for r in steps),
               "rollout_s": statistics.median(r["time/rollout"] for r in steps if "time/rollout" in r),
               "longest": statistics.mean(r["rollout/response_length_max"] for r in steps),
               "length_mean": statistics.mean(r["rollout/response_length_mean"] for r in steps)}
    if "rollout/partial/rounds" in steps[0]:
        figures.update(staleness_mean=statistics.mean(r["rollout/partial/token_staleness_mean"] for r in steps),
                       staleness_max=max(r["rollout/partial/token_staleness_max"] for r in steps),
                       carried=statistics.mean(r["rollout/partial/carried_samples"] for r in steps),
                       rounds=statistics.mean(r["rollout/partial/rounds"] for r in steps))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[32])
    parser.add_argument("--schedulers", nargs="+", default=list(PARTIAL_SCHEDULERS), choices=PARTIAL_SCHEDULERS,
                        help="partial rollouts' schedulers, each at every --chunk-tokens")
    parser.add_argument("--max-tokens", type=int, default=256, help="rollout.max_tokens")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--n", type=int, default=2, help="rollout.n")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of all runs (the machine may be shared)")
    parser.add_argument("overrides", nargs="*", help="further dotted overrides of every run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from megatron_gkd.recipes.tiny import build_assets

    root = pathlib.Path(tempfile.mkdtemp(prefix="bench_partial_"))
    assets = build_assets(root / "assets")
    common = harness.asset_overrides(assets) + harness.SKEWED_LENGTHS + [
        f"rollout.max_tokens={args.max_tokens}", f"rollout.max_model_len={args.max_tokens + 128}",
        f"rollout.n={args.n}", f"trainer.global_batch_size={args.global_batch_size}", "trainer.micro_batch_size=4",
        f"trainer.num_steps={args.steps}", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_interval=null",
        "checkpoint.save_at_end=false", "checkpoint.hf_at_end=false", "optim.lr_warmup_steps=0", *args.overrides]
    runs = {"one_step_off": ["trainer.scheduler=one_step_off"]}
    for scheduler in args.schedulers:
        for chunk in args.chunk_tokens:
            runs[f"{scheduler} {chunk}"] = [f"trainer.scheduler={scheduler}", f"rollout.partial.chunk_tokens={chunk}"]
    results = {}
    for repeat in range(args.repeats):  # each repeat runs one_step_off first: its ratios read runs minutes apart
        for name, overrides in runs.items():
            out = _run(root / f"{name.replace(' ', '_')}-{repeat}", common + overrides)
            results[name, repeat] = summary(out, args.skip, ahead=name.split()[0].endswith("one_step_off"))
            logger.info("%s (repeat %d): %s", name, repeat, results[name, repeat])
    print(f"steps {args.skip + 1}..{args.steps}, max_tokens {args.max_tokens}, {args.global_batch_size} samples "
          f"(n={args.n}) a step; runs in {root}")
    print(f"{'run':24s} {'rep':>3s} {'gen tok/s':>9s} {'/ base':>6s} {'trained tok/s':>13s} {'/ base':>6s} "
          f"{'rollout s':>9s} {'longest':>7s} {'mean len':>8s} {'stale mean':>10s} {'stale max':>9s} {'carried':>7s} "
          f"{'rounds':>6s}")
    for repeat in range(args.repeats):
        base = results["one_step_off", repeat]
        for name in runs:
            r = results[name, repeat]
            extra = (f"{r['staleness_mean']:10.2f} {r['staleness_max']:9.0f} {r['carried']:7.1f} {r['rounds']:6.1f}"
                     if "rounds" in r else f"{'-':>10s} {'-':>9s} {'-':>7s} {'-':>6s}")
            print(f"{name:24s} {repeat:3d} {r['gen_tok_s']:9.1f} {r['gen_tok_s'] / base['gen_tok_s']:6.2f} "
                  f"{r['trained_tok_s']:13.1f} {r['trained_tok_s'] / base['trained_tok_s']:6.2f} {r['rollout_s']:9.3f} "
                  f"{r['longest']:7.1f} {r['length_mean']:8.1f} {extra}")


def _run(out: pathlib.Path, overrides: list[str]) -> pathlib.Path:
    """One run; started again once if it fails (on a shared machine vLLM's CPU shared memory can collide at start)."""
    code, log = harness.run(out, overrides)
    if code:
        logger.warning("%s failed (%s); once more", out.name, log.strip().splitlines()[-1][:200] if log.strip() else code)
        out = out.with_name(out.name + "-again")
        code, log = harness.run(out, overrides)
    if code:
        raise SystemExit(f"{out} failed:\n{log[-3000:]}")
    return out

if __name__ == "__main__":
    main()

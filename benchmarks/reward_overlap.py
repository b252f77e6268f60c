"""Rewards beside the teacher request: is their time hidden behind it?

A step sends its teacher request (a future on a client thread, as ``TeacherClient.score_async`` does) and its
rewards (``RewardRunner.submit``, a worker process) and waits for both. This times, per batch:

- ``teacher``: the simulated teacher request alone (a sleep on a client thread: the trainer waits on a socket);
- ``both``: the teacher request and the rewards at once, waiting for both (what the step pays);
- ``serial``: the teacher request, then the rewards (what computing them on the step's thread would cost);
- ``rewards``: the rewards alone through the worker, and ``in-proc``: the same kind called in this process
  (the difference is the pipe, pickling and the runner's thread).

Batches: the demo's task (256 samples of the arithmetic recipe, ``final_answer``, every 4th answer wrong) and
long responses (256 of about 2,000 characters ending in ``\\boxed{}``, ``math_answer``), the latter to show what
pickling more text through the pipe costs. Medians over ``--trials``::

    .venv/bin/python benchmarks/reward_overlap.py                    # teacher 10 and 50 ms, about 10 s
    .venv/bin/python benchmarks/reward_overlap.py --teacher-ms 5 100 --trials 50
"""

import argparse
import concurrent.futures
import statistics
import time

from megatron_gkd.recipes import arithmetic
from megatron_gkd.rewards import RewardBatch, RewardConfig, RewardRunner, build_reward


def demo_batch(num_samples: int) -> RewardBatch:
    """The demo's prompts and reference responses, every 4th with a wrong last digit."""
    problems, _ = arithmetic.make_problems(num_samples, 16, seed=0)
    responses = [r["response"] if i % 4 else r["response"][:-1] + str((int(r["response"][-1]) + 1) % 10)
                 for i, r in enumerate(problems)]
    return RewardBatch([r["prompt"] for r in problems], responses,
                       [{"index": i, "answer": r["answer"]} for i, r in enumerate(problems)])


def long_batch(num_samples: int) -> RewardBatch:
    """MATH-style responses of about 2,000 characters, the answer boxed at the end."""
    filler = "We add the terms one at a time and check each step carefully. " * 32
    return RewardBatch([f"Problem {i}: compute {i} * 3." for i in range(num_samples)],
                       [f"{filler} So the answer is \\boxed{{{i * 3:,}}}." for i in range(num_samples)],
                       [{"index": i, "answer": str(i * 3)} for i in range(num_samples)])


def median_s(fn, trials: int) -> float:
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher-ms", type=float, nargs="+", default=[10.0, 50.0],
                        help="simulated teacher request times")
    parser.add_argument("--num-samples", type=int, default=256)
    parser.add_argument("--trials", type=int, default=30)
    args = parser.parse_args()
    cases = [("demo final_answer", RewardConfig(kind="final_answer"), demo_batch(args.num_samples)),
             ("long math_answer", RewardConfig(kind="math_answer"), long_batch(args.num_samples))]
    teacher_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="teacher-client")
    print(f"{args.num_samples} samples a batch, median of {args.trials} trials; times in ms")
    print(f"{'batch':18s} {'teacher':>8s} {'both':>8s} {'serial':>8s} {'rewards':>8s} {'in-proc':>8s} "
          f"{'both/teacher':>13s} {'serial/teacher':>15s}")
    for name, config, batch in cases:
        began = time.perf_counter()
        with RewardRunner(config) as runner:
            runner.wait_ready()
            start_s = time.perf_counter() - began
            values = runner.compute(batch).values  # warm: the first call imports what the kind needs
            assert len(values) == len(batch) and 0 < sum(values) <= len(batch), values[:8]
            in_process = build_reward(config)
            in_proc = median_s(lambda: in_process(batch.prompts, batch.responses, batch.records), args.trials)
            rewards = median_s(lambda: runner.compute(batch), args.trials)
            for teacher_ms in args.teacher_ms:
                def teacher():
                    return teacher_pool.submit(time.sleep, teacher_ms / 1000)

                def both():
                    futures = [teacher(), runner.submit(batch)]
                    for future in futures:
                        future.result()

                def serial():
                    teacher().result()
                    runner.compute(batch)

                alone = median_s(lambda: teacher().result(), args.trials)
                together, one_after = median_s(both, args.trials), median_s(serial, args.trials)
                print(f"{name:18s} {alone * 1e3:8.2f} {together * 1e3:8.2f} {one_after * 1e3:8.2f} "
                      f"{rewards * 1e3:8.2f} {in_proc * 1e3:8.2f} {together / alone:13.3f} {one_after / alone:15.3f}")
        print(f"{'':18s} worker start-up {start_s * 1e3:.0f} ms")
    teacher_pool.shutdown()


if __name__ == "__main__":
    main()

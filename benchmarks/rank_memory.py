"""Where a rank's memory goes, setting by setting (issue #49 items 1-3): our side of ``benchmarks/trl_compare.py`` run
once per memory setting at one shape, one after the other::

    python benchmarks/rank_memory.py --shape 0.1b --steps 4 --skip 1                      # copy against release
    python benchmarks/rank_memory.py --shape 0.6b --settings release fused recompute      # the cuts, one on another

Settings (``SETTINGS``), each its config overrides on top of the shape's layout (``trl_compare.OURS``):

=============  =================================================================================================
``copy``       the colocated ``hf`` engine keeps its own copy of the model (``rollout.release_weights=false``)
``release``    the engine reads the student's tensors in place and lets go of them during each update (the default)
``fused``      ``release`` and the fused loss (``loss.fused=true``: no ``[s, b, V/tp]`` logits or their gradient)
``recompute``  ``fused`` and full activation recomputation (``student.recompute=full``)
``selective``  ``fused`` and Megatron's selective recomputation (``student.recompute=selective``)
``local``      ``release`` with the teacher on the rank (``teacher.client=local``: one process, as TRL's trainer holds
               its teacher), scoring its top-k there instead of a teacher service sending hidden states
``local_full`` ``local`` with ``fused``'s and ``recompute``'s settings
=============  =================================================================================================

Figures per setting: the rank's and the teacher service's peak RSS and their sum (GiB), the median step and weight-sync
times after ``--skip`` steps, each as a ratio against the first setting of the same invocation. Runs land in
``<out>/<shape>/<setting>/``; a finished run is read again, not rerun (``--fresh`` reruns). ``--timeline`` also samples
each rank's resident memory (all, anonymous, file-backed: ``/proc/<pid>/status``) every 0.1 s into
``<out>/<shape>/<setting>/rss_timeline.tsv``, to see in which phase the peak falls (the run's ``train.log`` and
``metrics.jsonl`` date the phases).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import threading
import time

from teacher_memory import status  # benchmarks/ is the script's own directory
from trl_compare import median_after

ROOT = pathlib.Path(__file__).resolve().parents[1]
RELEASE = ["rollout.release_weights=true"]
SETTINGS = {
    "copy": ["rollout.release_weights=false"],
    "release": RELEASE,
    "fused": [*RELEASE, "loss.fused=true"],
    "recompute": [*RELEASE, "loss.fused=true", "student.recompute=full"],
    "selective": [*RELEASE, "loss.fused=true", "student.recompute=selective"],
}
LOCAL = ["teacher.client=local", "teacher.checkpoint={teacher}", "teacher.serve.model=null", "teacher.signal=topk"]
SETTINGS.update({"local": [*RELEASE, *LOCAL], "local_full": [*SETTINGS["recompute"], *LOCAL]})


def sample_ranks(marker: str, path: pathlib.Path, stop: threading.Event, period_s: float = 0.1) -> None:
    """Writes ``seconds pid rss anon file`` (GiB) of every trainer rank whose command line holds ``marker`` to ``path``
    every ``period_s`` until ``stop`` is set."""
    began = time.monotonic()
    with open(path, "w") as handle:
        handle.write("seconds\tpid\trss_gib\tanon_gib\tfile_gib\n")
        while not stop.wait(period_s):
            for entry in pathlib.Path("/proc").iterdir():
                try:
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    if "-m megatron_gkd.trainer.cli" not in command or marker not in command or "distributed.run" in command:
                        continue
                    figures = status(entry.name)
                except (OSError, ValueError):
                    continue  # not a process, or one that just ended
                gib = [figures[key] for key in ("VmRSS", "RssAnon", "RssFile")]
                handle.write(f"{time.monotonic() - began:.2f}\t{entry.name}\t" + "\t".join(f"{v:.3f}" for v in gib) + "\n")
            handle.flush()


def measure(shape: str, setting: str, args) -> tuple[float, float, float, float]:
    out = pathlib.Path(args.out) / shape / setting
    figures = out / "runs" / f"{shape}-{args.length}-ours" / "figures.json"
    if args.fresh and out.exists():
        shutil.rmtree(out)
    shared = pathlib.Path(args.out).resolve() / "assets"  # one student and teacher for every setting
    shared.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "assets").exists():
        (out / "assets").symlink_to(shared)
    if not figures.exists():
        stop = threading.Event()
        if args.timeline:
            threading.Thread(target=sample_ranks, args=(str(out.resolve()), out / "rss_timeline.tsv", stop),
                             daemon=True).start()
        try:
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trl_compare.py"), "--shapes", shape,
                            "--lengths", str(args.length), "--steps", str(args.steps), "--skip", str(args.skip),
                            "--systems", "ours", "--out", str(out), "--ours-override",
                            *(o.format(teacher=shared / shape / "teacher") for o in SETTINGS[setting])], check=True)
        finally:
            stop.set()
    run = json.loads(figures.read_text())
    return (max(run["peak_rss_gib"]), run["teacher_rss_gib"] or 0.0, median_after(run["step_times"], args.skip),
            median_after(run["phases"]["weight_sync"], args.skip))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="0.1b", choices=["tiny", "0.1b", "0.6b"])
    parser.add_argument("--settings", nargs="+", default=["copy", "release"], choices=list(SETTINGS))
    parser.add_argument("--length", type=int, default=24)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip", type=int, default=1)
    parser.add_argument("--out", default="outputs/rank_memory")
    parser.add_argument("--fresh", action="store_true", help="rerun settings that have finished before")
    parser.add_argument("--timeline", action="store_true",
                        help="sample each rank's resident memory every 0.1 s into <run>/rss_timeline.tsv")
    args = parser.parse_args()
    rows = {setting: measure(args.shape, setting, args) for setting in args.settings}
    base = next(iter(rows.values()))
    print(f"| {args.shape}: setting | rank peak RSS GiB | teacher peak RSS GiB | rank + teacher GiB | step s | "
          "weight sync s |\n|---|---:|---:|---:|---:|---:|")
    for setting, (rank, teacher, step, sync) in rows.items():
        cells = [(rank, base[0]), (teacher, base[1]), (rank + teacher, base[0] + base[1]), (step, base[2]),
                 (sync, base[3])]
        print(f"| {setting} | " + " | ".join(f"{v:.3f} ({v / ref:.2f}x)" if ref else f"{v:.3f}" for v, ref in cells)
              + " |")


if __name__ == "__main__":
    main()

"""What ``rollout.release_weights`` saves and costs (issue #49 item 1): our side of ``benchmarks/trl_compare.py`` run
twice at one shape, the colocated ``hf`` engine keeping its own copy of the model (``false``) and reading the
student's tensors in place, released during each update (the default), one after the other::

    python benchmarks/release_weights.py --shape 0.1b --steps 4 --skip 1

Figures per setting: the rank's peak RSS (GiB, ``platform.peak_rss_gib``), the median step and weight-sync times after
``--skip`` steps, and each as a ratio against ``false`` from the same run. Runs land in ``<out>/<setting>/``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

from trl_compare import median_after  # benchmarks/ is the script's own directory

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETTINGS = {"copy": "rollout.release_weights=false", "release": "rollout.release_weights=true"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="0.1b", choices=["tiny", "0.1b", "0.6b"])
    parser.add_argument("--length", type=int, default=24)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip", type=int, default=1)
    parser.add_argument("--out", default="outputs/release_weights")
    args = parser.parse_args()
    rows = {}
    for setting, override in SETTINGS.items():
        out = pathlib.Path(args.out) / setting
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trl_compare.py"), "--shapes", args.shape,
                        "--lengths", str(args.length), "--steps", str(args.steps), "--skip", str(args.skip),
                        "--systems", "ours", "--out", str(out), "--ours-override", override], check=True)
        run = json.loads((out / "runs" / f"{args.shape}-{args.length}-ours" / "figures.json").read_text())
        rows[setting] = (max(run["peak_rss_gib"]), median_after(run["step_times"], args.skip),
                         median_after(run["phases"]["weight_sync"], args.skip))
    base = rows["copy"]
    print("| rollout.release_weights | rank peak RSS GiB | step s | weight sync s |\n|---|---:|---:|---:|")
    for setting, row in rows.items():
        cells = " | ".join(f"{value:.3f} ({value / ref:.2f}x)" for value, ref in zip(row, base, strict=True))
        print(f"| {SETTINGS[setting].split('=')[1]} | {cells} |")


if __name__ == "__main__":
    main()

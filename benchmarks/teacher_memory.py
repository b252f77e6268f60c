"""Where a served teacher's memory goes (issue #49 item 4): the hf backend's peak RSS against its model's size.

    python benchmarks/teacher_memory.py --shape 0.6b           # the 0.6B shape of benchmarks/trl_compare.py
    python benchmarks/teacher_memory.py --shape 0.1b --batches 16x36 64x128
    python benchmarks/teacher_memory.py --backend megatron --batches 16x36 --signals topk    # the Megatron teacher

Each measurement is a fresh process (its peak RSS is its own): import, build the backend (`hf`, float32, as the
teacher service builds it), score one batch of random sequences twice, then report the peak RSS (`VmHWM`) and the
peaks of its two parts, sampled every 2 ms: anonymous memory (`RssAnon`: tensors, the allocator) and file-backed
pages (`RssFile`: the libraries, and the checkpoint's safetensors, which transformers maps and uses in place). Two
paths: `chunked` (the backend's: the decoder once, the output layer on the response rows a chunk at a time) and
`whole` (the fallback for models whose logits are not their output layer on the last hidden state: the logits of
every position at once), forced here by the probe's answer. The floor is the model's parameter bytes plus the
process before the backend (torch and transformers imported).

``--backend megatron``: the Megatron-Core teacher of ``teacher.client=local`` and the ``megatron`` backend (one gloo
rank, ``load_hf`` and ``MegatronScorer``), its two paths `copied` (``load_hf(in_place=False)``: every parameter a
copy) and `mapped` (``in_place=True``, how the teacher loads: the tensors the checkpoint stores as they are are slices
of its memory map).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def status(pid: int | str = "self") -> dict[str, float]:
    """A process's memory figures (``KEYS`` of ``/proc/<pid>/status``), GiB; this process's by default. Imports
    nothing beyond the standard library: ``rank_memory.py`` samples the ranks with it, ``trl_side.py`` (TRL's own
    virtualenv) reads itself."""
    figures = {}
    with open(f"/proc/{pid}/status") as lines:
        for line in lines:
            key, value = line.split(":", 1)
            if key in KEYS:
                figures[key] = int(value.split()[0]) / 2**20
    return figures


def megatron_scorer(teacher: str, in_place: bool):
    """One gloo rank's Megatron teacher: ``(score(batch), tokenizer size, parameters)``."""
    import os

    import torch.distributed as dist

    from megatron_gkd import parallel, platform
    from megatron_gkd.teacher.backends.megatron_scoring import MegatronScorer, load_teacher

    platform.setup()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    chunks, vocab = load_teacher(teacher, state=parallel.initialize(), in_place=in_place)
    scorer = MegatronScorer(chunks, vocab, platform.device())
    return scorer.score, vocab.tokenizer_size, [p for chunk in chunks for p in chunk.parameters()]


def child(teacher: str, path: str, signal: str, rows: int, length: int) -> dict:
    peaks = {"RssAnon": 0.0, "RssFile": 0.0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            figures = status()
            for key in peaks:
                peaks[key] = max(peaks[key], figures[key])
            time.sleep(0.002)

    import numpy as np
    import torch

    from megatron_gkd.teacher.backends import hf
    from megatron_gkd.teacher.protocol.types import ScoreBatch, SequenceRequest

    torch.set_num_threads(1)
    threading.Thread(target=sample, daemon=True).start()
    before = status()
    if path in ("copied", "mapped"):
        score, vocab, parameters = megatron_scorer(teacher, in_place=path == "mapped")
    else:
        if path == "whole":
            hf.HFBackend._head_is_last = lambda self: False
        backend = hf.HFBackend(teacher)
        score, vocab, parameters = backend.score, backend.info().tokenizer_size, list(backend._model.parameters())
    rng = np.random.default_rng(0)
    prompt = max(1, length // 3)
    batch = ScoreBatch(sequences=[SequenceRequest(token_ids=rng.integers(5, vocab, length),
                                                  response_start=prompt) for _ in range(rows)],
                       top_k=16, signal=signal, hidden_dtype="float32")
    times = []
    for _ in range(2):
        start = time.perf_counter()
        score(batch)
        times.append(time.perf_counter() - start)
    time.sleep(0.01)
    done.set()
    model = sum(p.numel() * p.element_size() for p in parameters) / 2**30
    return {"path": path, "signal": signal, "rows": rows, "length": length, "before_gib": before["VmRSS"],
            "peak_gib": status()["VmHWM"], "anon_peak_gib": peaks["RssAnon"], "file_peak_gib": peaks["RssFile"],
            "model_gib": model, "score_s": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="0.6b", choices=["tiny", "0.1b", "0.6b"])
    parser.add_argument("--batches", nargs="+", default=["16x36", "16x512"],
                        help="ROWSxLENGTH: sequences and their tokens (a third prompt); 16x36 is trl_compare's")
    parser.add_argument("--signals", nargs="+", default=["hidden", "topk"])
    parser.add_argument("--backend", default="hf", choices=["hf", "megatron"])
    parser.add_argument("--root", default="outputs/trl_compare", help="where trl_compare builds its assets")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return
    sys.path.insert(0, str(HERE))
    from trl_compare import build_assets

    teacher = build_assets(pathlib.Path(args.root).resolve(), args.shape, 64) / "teacher"
    print("| path | signal | batch | peak RSS GiB | anon peak | file-backed peak | before the backend | model | "
          "peak - model - before | score s |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for batch in args.batches:
        rows, length = (int(part) for part in batch.split("x"))
        for signal in args.signals:
            for path in ("whole", "chunked") if args.backend == "hf" else ("copied", "mapped"):
                spec = json.dumps({"teacher": str(teacher), "path": path, "signal": signal, "rows": rows,
                                   "length": length})
                result = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True)
                if result.returncode:
                    print(f"| {path} | {signal} | {batch} | failed: {result.stderr.strip().splitlines()[-1]} |")
                    continue
                r = json.loads(result.stdout.strip().splitlines()[-1])
                print(f"| {path} | {signal} | {batch} | {r['peak_gib']:.2f} | {r['anon_peak_gib']:.2f} | "
                      f"{r['file_peak_gib']:.2f} | {r['before_gib']:.2f} | {r['model_gib']:.2f} | "
                      f"{r['peak_gib'] - r['model_gib'] - r['before_gib']:.2f} | {r['score_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()

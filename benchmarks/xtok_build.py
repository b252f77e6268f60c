"""Cost of the cross-tokenizer CPU side: building the projection map W for two ~150k-entry tokenizers, and aligning
responses (issue #29 points 3 and 4).

    python benchmarks/xtok_build.py                      # two 150k BPE tokenizers, cached under outputs/xtok_build/
    python benchmarks/xtok_build.py --vocab-size 32000   # smaller, quicker

The two tokenizers are trained here (nothing is downloaded) on generated text of two different "languages":
pseudo-words from two lexicons that share their more frequent half, numbers, punctuation and some multi-byte
text. The student is a GPT-2-style byte-level BPE that writes one digit per token (Qwen's numerals); the
teacher a SentencePiece-style BPE with ``▁`` and byte fallback that keeps numbers whole (Llama's). Trained once and
cached as tokenizer.json files (about a minute each on a quiet 2-core machine).

Reported: W's build seconds (student -> teacher, the direction the loss uses), its entries, exact rows, empty rows,
size on disk (npz), the size of each TP rank's share (rows sharded by student id like the output layer), and the
aligner's cost per 1,000 response tokens from ids (``align_ids``: the teacher request path, which has both sides'
ids) and from text (``align_text``: encodes with both tokenizers too), with the share of response positions in
each kind of group.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import random
import statistics
import sys
import time

import numpy as np

from megatron_gkd.testing import xtok_tokenizers as toks
from megatron_gkd.xtok import Kind, align_ids, align_text, build_projection, token_table

CONSONANTS, VOWELS = "bcdfghjklmnprstvwz", "aeiouy"
SYLLABLES = [c + v for c in CONSONANTS for v in VOWELS] + [c + v + c2 for c in CONSONANTS for v in VOWELS
                                                          for c2 in "nrst"]


def _words(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(num)]


def corpus(num_words: int, seed: int) -> list[str]:
    """Lines of pseudo-words (Zipf-like reuse), numbers, punctuation and a little multi-byte text. Two seeds share
    the more frequent half of their lexicons (one language, two corpora) and differ in the rest."""
    rng = random.Random(seed)
    lexicon = _words(num_words // 2, 12345) + _words(num_words - num_words // 2, seed)
    cumulative = list(itertools.accumulate(1.0 / (rank + 10) for rank in range(num_words)))
    lines = []
    for _ in range(num_words // 8):
        words = rng.choices(lexicon, cum_weights=cumulative, k=12)
        words[rng.randrange(12)] = str(rng.randint(0, 10 ** rng.randint(1, 5)))
        if rng.random() < 0.05:
            words[rng.randrange(12)] = rng.choice(toks.EXTRA)
        lines.append(" ".join(words) + rng.choice([".", ",", "?", "!", ":"]))
    return lines + lexicon  # every word at least once: enough distinct words for the merges


def trained(out: pathlib.Path, vocab_size: int):
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    built = {}
    for name, seed, train in (("student", 0, toks.bytelevel_digits), ("teacher", 1, toks.metaspace_numbers)):
        path = out / f"{name}_{vocab_size}.json"
        if path.exists():
            built[name] = Tokenizer.from_file(str(path))
            continue
        start = time.perf_counter()
        built[name] = train(corpus(vocab_size * 2, seed), vocab_size=vocab_size)
        built[name].save(str(path))
        print(f"trained {name} ({built[name].get_vocab_size()} ids) in {time.perf_counter() - start:.0f} s -> {path}")
    return built["student"], built["teacher"]


def responses(num: int, length: int, seed: int) -> list[str]:
    """Response-like text: both languages' words, numbers, arithmetic and some multi-byte text."""
    lines = corpus(4000, seed) + corpus(4000, seed + 1)
    rng = random.Random(seed)
    return [" ".join(rng.choice(lines) for _ in range(length)) for _ in range(num)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=150_000)
    parser.add_argument("--out", default=os.environ.get("MEGATRON_GKD_OUTPUTS", "outputs") + "/xtok_build")
    parser.add_argument("--num-responses", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    student, teacher = trained(out, args.vocab_size)
    print(f"student {student.get_vocab_size()} ids (byte-level, single digits), teacher {teacher.get_vocab_size()} ids "
          "(metaspace + byte fallback, whole numbers)")

    times, cpu = [], []  # wall and CPU seconds: CPU is the figure to trust on a shared, loaded machine
    for _ in range(args.repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        projection = build_projection(student, teacher)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    path = projection.save(out / f"w_{args.vocab_size}.npz")
    stats = projection.stats()
    print(f"build W: {min(times):.2f} s wall, {min(cpu):.2f} s CPU (min of {args.repeats}; median wall "
          f"{statistics.median(times):.2f} s)")
    print(f"  rows {stats['rows']}, mapped {stats['mapped']}, exact {stats['exact']}, empty {stats['empty']}, "
          f"nnz {stats['nnz']} ({stats['mean_row']:.2f} a mapped row, at most {stats['max_row']})")
    print(f"  on disk {path.stat().st_size / 2**20:.2f} MiB ({path})")
    for tp in (1, 2, 4, 8):
        per_rank = projection.rank_nbytes(tp)
        print(f"  TP={tp}: {max(per_rank) / 2**20:.2f} MiB on the largest rank (COO + exact slice)")

    student_table, teacher_table = token_table(student), token_table(teacher)
    texts = responses(args.num_responses, 40, seed=7)
    encoded = [(student.encode(t, add_special_tokens=False).ids, teacher.encode(t, add_special_tokens=False).ids)
               for t in texts]
    num_tokens = sum(len(s) for s, _ in encoded)
    kinds = np.zeros(len(Kind), dtype=np.int64)
    best_ids, best_text = float("inf"), float("inf")  # CPU seconds (process_time), min over repeats
    for _ in range(args.repeats):
        start = time.process_time()
        for s_ids, t_ids in encoded:
            align_ids(s_ids, t_ids, student_table, teacher_table)
        best_ids = min(best_ids, time.process_time() - start)
        start = time.process_time()
        for text in texts:
            align_text(text, student, teacher, student_table, teacher_table)
        best_text = min(best_text, time.process_time() - start)
    for s_ids, t_ids in encoded:
        kinds += np.bincount(align_ids(s_ids, t_ids, student_table, teacher_table).kind, minlength=len(Kind))
    per_k = 1000 / num_tokens
    print(f"align {args.num_responses} responses, {num_tokens} student tokens (CPU time): align_ids "
          f"{best_ids * per_k * 1e3:.2f} ms per 1,000 response tokens, align_text (both encodes included) "
          f"{best_text * per_k * 1e3:.2f} ms")
    shares = ", ".join(f"{kind.name.lower()} {kinds[kind] / kinds.sum():.1%}" for kind in Kind)
    print(f"  student positions per group kind: {shares}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

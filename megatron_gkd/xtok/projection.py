"""The sparse map ``W`` from each student token to a few teacher tokens (X-Token's projection, built once).

X-Token (arXiv 2605.21699; NeMo-RL #2347/#2508/#2797) compares the student's distribution projected into the
teacher's vocabulary, ``q(t) = sum_s p(s) W[s, t]``, with the teacher's (P-KL), or uses exact matches where they
exist and the projection elsewhere (H-KL, the hybrid GOLD started). ``W`` comes from the two tokenizers' strings
alone, with no model and no training (X-Token's "tokenizer-level string rules"); this module builds it:

1. Every id of both tokenizers as the bytes it writes (:mod:`.tokens`: byte-level ``Ġ``, SentencePiece ``▁``,
   byte fallback ``<0xNN>`` and WordPiece ``##`` undone), so the rules compare text, not spellings.
2. **Exact match, pinned**: a student token whose bytes are one teacher token's bytes gets that token alone,
   weight 1 (``exact[s]``; H-KL's mask). Special tokens match by their content (``</s>`` = ``</s>``) or through
   ``special_pairs``; every other special token and every padding row past the tokenizer get an empty row: no
   mass reaches the teacher from them, and the loss counts them as unmapped.
3. **Re-tokenised**: otherwise the teacher's model tokenises the student token's bytes as one word, spelt in
   the teacher's alphabet (``TokenTable.spell``: ``Ġ``/bytes or ``▁``), e.g. ``"2024"`` -> ``"20" "24"``; the
   first ``max_pieces`` pieces share the row with front-loaded weights ``decay**i``, normalised to 1 (repeated
   pieces add up). The model, not the whole pipeline: a SentencePiece pipeline adds a dummy prefix space, which
   would turn every word-internal piece (``"ing"``) into a word start (``"▁ing"``). Where the teacher's spelling
   cannot hold the bytes (part of a character, outside byte-level BPE) or the result does not write the same bytes
   (a normaliser, an unknown token), the greedy longest-prefix cover by the teacher's pieces is used instead.
   Bytes no teacher token writes leave the row empty (counted in :meth:`ProjectionMap.stats`).

Why front-loaded: at a group's head (:mod:`.align`) the teacher predicts its *first* piece; a student token's
mass on later pieces is a hedge X-Token keeps (rows of "up to a few teacher tokens", ranked, H-KL's top-ranked
mapping is the first). ``decay=0`` is the strict chain-rule map (first piece only; every row one entry), ``1``
spreads evenly. ``decay=0.5`` (the default) gives the first piece 8/15 of a 4-piece row.

Contract with the loss (:func:`megatron_gkd.losses.cross_vocab.loss.shard_projection`): COO ``student_ids`` int64,
``teacher_ids`` int64, ``weights`` float32, sorted by (student, teacher), no duplicate pair; each mapped row sums
to 1 (float32); ``exact`` ``[student_vocab_size]`` bool with one-hot rows. The map is saved as ``.npz`` with a
blake3 hash of its content and both tokenizers' digests (:func:`megatron_gkd.data.tokenization.tokenizer_digest`,
the ones the teacher's INFO and the teacher cache carry), so a run refuses a map built for another pair.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import Any

import blake3
import numpy as np

from megatron_gkd.xtok.tokens import TokenTable, backend, token_table

logger = logging.getLogger(__name__)

FORMAT = "megatron_gkd.xtok.projection/1"


@dataclasses.dataclass(frozen=True, slots=True)
class ProjectionMap:
    """``W`` as COO entries; see the module docstring for the contract.

    Attributes:
        student_ids, teacher_ids: ``[nnz]`` int64 row (student id) and column (teacher id) of each entry.
        weights: ``[nnz]`` float32, each mapped row sums to 1.
        exact: ``[student_vocab_size]`` bool, student tokens whose row is one exact teacher match (H-KL's mask).
        student_vocab_size, teacher_vocab_size: rows of each side's output layer (padding rows included).
        student_digest, teacher_digest: the tokenizers the map was built from.
        max_pieces, decay: the re-tokenisation rule's parameters.
    """

    student_ids: np.ndarray
    teacher_ids: np.ndarray
    weights: np.ndarray
    exact: np.ndarray
    student_vocab_size: int
    teacher_vocab_size: int
    student_digest: str
    teacher_digest: str
    max_pieces: int
    decay: float

    @property
    def nnz(self) -> int:
        return len(self.weights)

    def content_hash(self) -> str:
        """blake3 over the arrays and every scalar field (what :meth:`load` checks)."""
        hasher = blake3.blake3()
        for array in (self.student_ids, self.teacher_ids, self.weights, self.exact):
            hasher.update(np.ascontiguousarray(array).tobytes())
        hasher.update(json.dumps(self._meta(), sort_keys=True).encode())
        return hasher.hexdigest()

    def _meta(self) -> dict:
        return dict(format=FORMAT, student_vocab_size=self.student_vocab_size,
                    teacher_vocab_size=self.teacher_vocab_size, student_digest=self.student_digest,
                    teacher_digest=self.teacher_digest, max_pieces=self.max_pieces, decay=self.decay)

    def stats(self) -> dict[str, int | float]:
        """Rows mapped, exact, empty (unmapped or padding), entries, and the largest row."""
        per_row = np.bincount(self.student_ids, minlength=self.student_vocab_size)
        mapped = int((per_row > 0).sum())
        return dict(rows=self.student_vocab_size, mapped=mapped, exact=int(self.exact.sum()),
                    empty=self.student_vocab_size - mapped, nnz=self.nnz, max_row=int(per_row.max(initial=0)),
                    mean_row=self.nnz / max(mapped, 1))

    def rank_nbytes(self, tensor_model_parallel_size: int) -> list[int]:
        """Bytes of each TP rank's share (rows sharded by student id like the output layer: rank r holds
        ``[r V/tp, (r+1) V/tp)`` with ``V/tp`` rounded up), as COO plus its slice of ``exact``."""
        tp = tensor_model_parallel_size
        per_rank = -(-self.student_vocab_size // tp)
        counts = np.bincount(self.student_ids // per_rank, minlength=tp)
        entry = self.student_ids.itemsize + self.teacher_ids.itemsize + self.weights.itemsize
        return [int(count) * entry + per_rank for count in counts]

    def check_pair(self, *, student_digest: str, teacher_digest: str) -> None:
        """Raises ValueError unless the map was built for these two tokenizers."""
        for side, want, have in (("student", student_digest, self.student_digest),
                                 ("teacher", teacher_digest, self.teacher_digest)):
            if want != have:
                raise ValueError(f"this projection map was built for another {side} tokenizer (map {have[:12]}, "
                                 f"run {want[:12]}); rebuild it for this pair")

    def save(self, path: str | pathlib.Path) -> pathlib.Path:
        """Writes ``path`` (``.npz``): the arrays, the metadata and the content hash."""
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(self._meta(), content_hash=self.content_hash())
        with path.open("wb") as handle:  # a file object: np.savez would otherwise append .npz to the name
            np.savez(handle, student_ids=self.student_ids, teacher_ids=self.teacher_ids, weights=self.weights,
                     exact=self.exact, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
        return path

    @classmethod
    def load(cls, path: str | pathlib.Path, *, student_digest: str | None = None,
             teacher_digest: str | None = None) -> ProjectionMap:
        """Reads a map written by :meth:`save`; refuses a corrupted file or (given digests) another pair."""
        with np.load(pathlib.Path(path), allow_pickle=False) as data:
            meta = json.loads(data["meta"].tobytes().decode())
            arrays = {name: data[name] for name in ("student_ids", "teacher_ids", "weights", "exact")}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not a projection map of this version ({meta.get('format')!r}, want {FORMAT!r})")
        expected = meta.pop("content_hash")
        meta.pop("format")
        loaded = cls(**arrays, **meta)
        if loaded.content_hash() != expected:
            raise ValueError(f"{path}: content hash mismatch (file corrupted or edited); rebuild the map")
        if student_digest is not None or teacher_digest is not None:
            loaded.check_pair(student_digest=student_digest or loaded.student_digest,
                              teacher_digest=teacher_digest or loaded.teacher_digest)
        return loaded


def special_names(tokenizer: Any, table: TokenTable) -> dict[str, int]:
    """The tokenizer's special tokens by their string (``"</s>"`` -> its id): what pairs two tokenizers' specials."""
    core = backend(tokenizer)
    convert = core.id_to_token if core is not None else (lambda i: tokenizer.convert_ids_to_tokens(int(i)))
    return {convert(int(i)): int(i) for i in np.flatnonzero(table.special) if convert(int(i)) is not None}


def _greedy_cover(piece: bytes, by_bytes: dict[bytes, int], longest: int) -> list[int] | None:
    """Longest-prefix cover of ``piece`` by teacher pieces, or None if some byte has no teacher token."""
    out, at = [], 0
    while at < len(piece):
        for size in range(min(longest, len(piece) - at), 0, -1):
            found = by_bytes.get(piece[at:at + size])
            if found is not None:
                out.append(found)
                at += size
                break
        else:
            return None
    return out


def _retokenised(student: TokenTable, teacher: TokenTable, teacher_tokenizer: Any, rows: np.ndarray,
                 by_bytes: dict[bytes, int]) -> dict[int, list[int]]:
    """Teacher ids of each student row's bytes: the teacher's model on them, else the greedy byte cover."""
    longest = max(map(len, by_bytes), default=1)
    core = backend(teacher_tokenizer)
    out = {}
    for s in rows:
        piece = student.pieces[s]
        spelled = teacher.spell(piece)
        if spelled is None:  # part of a character: only byte tokens can cover it
            out[int(s)] = _greedy_cover(piece, by_bytes, longest)
            continue
        ids = [token.id for token in core.model.tokenize(spelled)] if core is not None else \
            teacher_tokenizer.encode(spelled, add_special_tokens=False)
        out[int(s)] = ids if teacher.text(ids) == piece else _greedy_cover(piece, by_bytes, longest)
    return out


def build_projection(student_tokenizer: Any, teacher_tokenizer: Any, *, student_vocab_size: int | None = None,
                     teacher_vocab_size: int | None = None, max_pieces: int = 4, decay: float = 0.5,
                     special_pairs: dict[int, int] | None = None) -> ProjectionMap:
    """Builds ``W`` from the two tokenizers (see the module docstring for the rules).

    Args:
        student_tokenizer, teacher_tokenizer: ``tokenizers.Tokenizer`` or transformers tokenizers.
        student_vocab_size, teacher_vocab_size: rows of each output layer (default: the tokenizer's size); rows
            past the student's tokenizer are padding and stay empty.
        max_pieces: at most this many teacher tokens per row (X-Token's "a few").
        decay: weight of the i-th piece is ``decay**i`` before normalising (0: first piece only).
        special_pairs: student special id -> teacher special id, besides the pairs with the same content.

    Raises:
        ValueError: sizes smaller than the tokenizers, or bad ``max_pieces`` / ``decay``.
    """
    if max_pieces < 1 or not 0.0 <= decay <= 1.0:
        raise ValueError(f"max_pieces must be >= 1 and decay in [0, 1], got {max_pieces}, {decay}")
    student, teacher = token_table(student_tokenizer), token_table(teacher_tokenizer)
    student_vocab_size = student.vocab_size if student_vocab_size is None else student_vocab_size
    teacher_vocab_size = teacher.vocab_size if teacher_vocab_size is None else teacher_vocab_size
    for side, rows, table in (("student", student_vocab_size, student), ("teacher", teacher_vocab_size, teacher)):
        if rows < table.vocab_size:
            raise ValueError(f"{side}_vocab_size {rows} is smaller than the {side} tokenizer ({table.vocab_size} ids)")

    by_bytes: dict[bytes, int] = {}  # teacher piece -> lowest id writing it; text tokens before byte fallback
    writes = ~teacher.special & (teacher.lengths > 0)
    for t in np.concatenate([np.flatnonzero(writes & ~teacher.byte_tokens), np.flatnonzero(writes & teacher.byte_tokens)]):
        by_bytes.setdefault(teacher.pieces[t], int(t))
    teacher_specials = special_names(teacher_tokenizer, teacher)
    pairs = {s: teacher_specials[name] for name, s in special_names(student_tokenizer, student).items()
             if name in teacher_specials}
    pairs.update(special_pairs or {})

    rows: dict[int, list[int]] = {}
    exact = np.zeros(student_vocab_size, dtype=bool)
    for s, t in pairs.items():
        rows[s] = [t]
        exact[s] = True
    text_rows = np.flatnonzero(~student.special & (student.lengths > 0))
    remaining = []
    for s in text_rows:
        t = by_bytes.get(student.pieces[s])
        if t is not None:
            rows[int(s)] = [t]
            exact[s] = True
        else:
            remaining.append(s)
    unmapped = 0
    for s, ids in _retokenised(student, teacher, teacher_tokenizer, np.asarray(remaining, np.int64),
                               by_bytes).items():
        if ids:
            rows[s] = ids[:max_pieces]
        else:
            unmapped += 1
    if unmapped:
        logger.info("projection: %d student tokens write bytes no teacher token covers; their rows are empty",
                    unmapped)

    student_ids, teacher_ids, weights = [], [], []
    for s in sorted(rows):
        share: dict[int, float] = {}
        for i, t in enumerate(rows[s][:1] if decay == 0 else rows[s]):
            share[t] = share.get(t, 0.0) + decay ** i
        total = sum(share.values())
        for t in sorted(share):
            student_ids.append(s)
            teacher_ids.append(t)
            weights.append(share[t] / total)
    return ProjectionMap(student_ids=np.asarray(student_ids, dtype=np.int64),
                         teacher_ids=np.asarray(teacher_ids, dtype=np.int64),
                         weights=np.asarray(weights, dtype=np.float32), exact=exact,
                         student_vocab_size=int(student_vocab_size), teacher_vocab_size=int(teacher_vocab_size),
                         student_digest=student.digest, teacher_digest=teacher.digest, max_pieces=int(max_pieces),
                         decay=float(decay))

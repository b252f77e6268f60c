"""Aligning the student's and the teacher's tokenisations of one response by the text they write.

The student wrote a response in its own ids; the teacher scores its own tokenisation of the same text (the
teacher service gets the text or teacher-side ids, never the student's ids). Both sequences cover the same
bytes, so the positions are matched by byte spans: a **group** is the smallest run of student tokens and run of
teacher tokens that end at the same byte. Every byte of the response lies in exactly one group.

| kind | student : teacher | example (student / teacher) | compared position |
|---|---|---|---|
| ``ONE_TO_ONE`` | 1 : 1 | ``" the"`` / ``"Ġthe"`` | the pair |
| ``ONE_TO_MANY`` | 1 : n | ``"123"`` / ``"1" "2" "3"`` | student token vs the teacher's first |
| ``MANY_TO_ONE`` | n : 1 | ``"1" "2" "3"`` / ``"123"`` | the group's first student token only |
| ``MANY_TO_MANY`` | n : m | ``"ab" "cd"`` / ``"a" "bcd"`` | the group's first student token only |
| ``SPECIAL`` | 1 : 1 | ``</s>`` / ``<|im_end|>`` (a pair the caller names) | the pair |
| ``UNALIGNED`` | 1 : 0 | a special token the teacher has no partner for | none (skipped, counted) |

**Which positions are compared, and why (the chain rule).** A student token ``s`` at the head of its group is
predicted from the same text prefix as the teacher's first token of the group, so the student's next-token
distribution there and the teacher's are distributions over the same event (what text comes next), in two
vocabularies: X-Token's projection ``W`` (:mod:`.projection`) maps ``s`` onto the teacher tokens of its own
re-tokenisation, and the two are compared there (P-KL; H-KL where an exact match exists). Inside a group the
later student tokens are predicted from a prefix that ends mid-way through a teacher token: the teacher has no
distribution conditioned on that prefix. GOLD merges the group's probabilities instead (chain rule over the
group), which needs every position's full distribution on both sides; with a top-k teacher signal and a
vocab-parallel student that is not available, so this design compares one position per group (the head) and
skips the others, and :meth:`Alignment.counts` reports how many positions of each kind there are (the share the
issue asks to measure). ``Alignment.teacher_position`` is the result in one array.

**How spans are found.** From the pieces (:mod:`.tokens`: the bytes each id writes; byte fallback, ``▁``/``Ġ``
markers and WordPiece ``##`` already undone) when both concatenations equal each other up to one dummy prefix
space (SentencePiece's ``add_dummy_prefix``); that is exact for partial UTF-8 characters, which character
offsets cannot split. Otherwise (a normaliser changed the text: lower-casing, NFKC, WordPiece dropping spaces)
from the fast tokenizers' offsets into the original text (:func:`align_text`), converted to byte offsets; two
tokens sharing one character then fall into one group. Special tokens write no text: they are paired only
through ``special_pairs`` (student id -> teacher id, e.g. EOS with EOS) at the same text position.

**A chat template on one side only.** Prompts are not aligned: each side renders its own prompt (its own
template), and only the response positions are compared. The teacher's response ids must be the response text
encoded on its own (so a token boundary lies at the response start on both sides); ``student_prompt_len`` /
``teacher_prompt_len`` say where the responses start in full sequences.

Cost: numpy over the token arrays plus one join of the pieces to check the texts agree; measured per 1,000
response tokens in ``benchmarks/xtok_build.py`` (figures in docs/performance.md). It runs on the CPU beside the
teacher request, off the training step.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from megatron_gkd.xtok.tokens import TokenTable, backend


class Kind(enum.IntEnum):
    """What kind of group a student position belongs to (``Alignment.kind``)."""

    ONE_TO_ONE = 0
    ONE_TO_MANY = 1
    MANY_TO_ONE = 2
    MANY_TO_MANY = 3
    SPECIAL = 4
    UNALIGNED = 5


@dataclasses.dataclass(frozen=True, slots=True)
class Alignment:
    """The groups of one response, per student position (positions count response tokens from 0).

    Attributes:
        kind: ``[n_s]`` uint8 :class:`Kind` of each student position's group.
        student_start: ``[n_s]`` int32 first student position of the group (-1 if unaligned).
        teacher_start: ``[n_s]`` int32 first teacher position of the group (-1 if unaligned).
        teacher_end: ``[n_s]`` int32 one past the group's last teacher position (-1 if unaligned).
        num_teacher: teacher response positions aligned over.
    """

    kind: np.ndarray
    student_start: np.ndarray
    teacher_start: np.ndarray
    teacher_end: np.ndarray
    num_teacher: int

    @property
    def head(self) -> np.ndarray:
        """``[n_s]`` bool: the position is the first student token of an aligned group (it is compared)."""
        return (self.student_start == np.arange(len(self.kind))) & (self.kind != Kind.UNALIGNED)

    @property
    def teacher_position(self) -> np.ndarray:
        """``[n_s]`` int32: the teacher response position whose distribution each student position is
        compared with, or -1 (inside a multi-token group, or unaligned)."""
        return np.where(self.head, self.teacher_start, -1).astype(np.int32)

    def counts(self) -> dict[str, int]:
        """Student positions per :class:`Kind`, and ``compared`` (heads) and ``total``."""
        found = np.bincount(self.kind, minlength=len(Kind))
        out = {kind.name.lower(): int(found[kind]) for kind in Kind}
        out.update(compared=int(self.head.sum()), total=len(self.kind))
        return out


def _groups(student_ends: np.ndarray, teacher_ends: np.ndarray):
    """Group index of each token from monotone byte end offsets that both finish at the same byte."""
    cuts = np.intersect1d(student_ends, teacher_ends)
    cuts = cuts[cuts > 0]  # a zero-length token at the start joins the first group
    return np.searchsorted(cuts, student_ends, "left"), np.searchsorted(cuts, teacher_ends, "left"), len(cuts)


def align_spans(student_ends: np.ndarray, teacher_ends: np.ndarray, *, student_special: np.ndarray,
                teacher_special: np.ndarray, student_ids: np.ndarray | None = None,
                teacher_ids: np.ndarray | None = None, special_pairs: dict[int, int] | None = None) -> Alignment:
    """Groups from each token's byte end offset into the response text (the core of both entry points).

    Args:
        student_ends, teacher_ends: ``[n_s]``, ``[n_t]`` byte offset where each token ends (special tokens: where
            they stand). Made monotone here; the last text token of each side must end at the text's end.
        student_special, teacher_special: ``[n_s]``, ``[n_t]`` bool, tokens that write no text.
        student_ids, teacher_ids, special_pairs: pair a student special token with the teacher's
            ``special_pairs[id]`` at the same offset (e.g. EOS with EOS); without them specials are unaligned.
            If one side has no text token at all (a WordPiece tokenizer drops a response of whitespace), the other
            side's tokens are unaligned.

    Raises:
        ValueError: the two sides do not end at the same byte (they do not write the same text).
    """
    student_ends = np.maximum.accumulate(np.asarray(student_ends, dtype=np.int64)) if len(student_ends) else \
        np.zeros(0, np.int64)
    teacher_ends = np.maximum.accumulate(np.asarray(teacher_ends, dtype=np.int64)) if len(teacher_ends) else \
        np.zeros(0, np.int64)
    student_text, teacher_text = np.flatnonzero(~student_special), np.flatnonzero(~teacher_special)
    n_s = len(student_ends)
    kind = np.full(n_s, Kind.UNALIGNED, dtype=np.uint8)
    student_start, teacher_start, teacher_end = (np.full(n_s, -1, dtype=np.int32) for _ in range(3))
    if not (len(student_text) and len(teacher_text)):  # one side wrote nothing (only whitespace it drops): no groups
        student_text = teacher_text = np.zeros(0, dtype=np.int64)
    elif student_ends[student_text[-1]] != teacher_ends[teacher_text[-1]]:
        raise ValueError(f"the student's tokens write {student_ends[student_text[-1]]} bytes and the teacher's "
                         f"{teacher_ends[teacher_text[-1]]}: they do not cover the same response text")

    s_group, t_group, num_groups = _groups(student_ends[student_text], teacher_ends[teacher_text])
    s_count = np.bincount(s_group, minlength=num_groups)
    t_count = np.bincount(t_group, minlength=num_groups)
    group_kind = np.where(s_count == 1, np.where(t_count == 1, Kind.ONE_TO_ONE, Kind.ONE_TO_MANY),
                          np.where(t_count == 1, Kind.MANY_TO_ONE, Kind.MANY_TO_MANY)).astype(np.uint8)
    first_s = np.searchsorted(s_group, np.arange(num_groups), "left")
    first_t = np.searchsorted(t_group, np.arange(num_groups), "left")
    last_t = np.searchsorted(t_group, np.arange(num_groups), "right")
    kind[student_text] = group_kind[s_group]
    student_start[student_text] = student_text[first_s[s_group]]
    teacher_start[student_text] = teacher_text[first_t[s_group]]
    teacher_end[student_text] = teacher_text[last_t[s_group] - 1] + 1

    if special_pairs and student_ids is not None and teacher_ids is not None:
        used = np.zeros(len(teacher_ends), dtype=bool)
        for i in np.flatnonzero(student_special):
            want = special_pairs.get(int(student_ids[i]))
            partners = np.flatnonzero(teacher_special & ~used & (teacher_ends == student_ends[i])
                                      & (np.asarray(teacher_ids) == want)) if want is not None else []
            if len(partners):
                j = partners[0]
                used[j] = True
                kind[i], student_start[i], teacher_start[i], teacher_end[i] = Kind.SPECIAL, i, j, j + 1
    return Alignment(kind=kind, student_start=student_start, teacher_start=teacher_start, teacher_end=teacher_end,
                     num_teacher=len(teacher_ends))


def _ends_from_pieces(table: TokenTable, ids: np.ndarray, skip: int) -> np.ndarray:
    lengths = table.lengths[ids]
    if skip:  # a dummy prefix space: the first text token writes it, the response does not
        first = np.flatnonzero(lengths)[0]
        lengths = lengths.copy()
        lengths[first] -= skip
    return np.cumsum(lengths)


def align_ids(student_ids, teacher_ids, student_table: TokenTable, teacher_table: TokenTable, *,
              student_prompt_len: int = 0, teacher_prompt_len: int = 0,
              special_pairs: dict[int, int] | None = None) -> Alignment:
    """Aligns two tokenisations of one response from the bytes their ids write (no offsets needed).

    Args:
        student_ids, teacher_ids: each side's ids; the response starts at ``*_prompt_len`` (each side's own
            prompt and template before it are not aligned).
        student_table, teacher_table: :func:`megatron_gkd.xtok.tokens.token_table` of each tokenizer.
        special_pairs: student special id -> teacher special id to pair at the same offset (e.g. EOS).

    Returns:
        The :class:`Alignment` of the response positions (index 0 = the first response token).

    Raises:
        ValueError: the two responses do not write the same bytes (up to one dummy prefix space): a normaliser
            changed the text; use :func:`align_text`, which reads the tokenizers' offsets.
    """
    student_ids = np.asarray(student_ids, dtype=np.int64)[student_prompt_len:]
    teacher_ids = np.asarray(teacher_ids, dtype=np.int64)[teacher_prompt_len:]
    student_text, teacher_text = student_table.text(student_ids), teacher_table.text(teacher_ids)
    skip_s = skip_t = 0
    if student_text != teacher_text:
        if student_text == b" " + teacher_text:
            skip_s = 1
        elif teacher_text == b" " + student_text:
            skip_t = 1
        else:
            raise ValueError("the student's and the teacher's response ids do not write the same bytes (a normaliser "
                             f"changed the text? student {student_text[:60]!r}, teacher {teacher_text[:60]!r}); "
                             "align the text with align_text, which reads the tokenizers' offsets")
    return align_spans(_ends_from_pieces(student_table, student_ids, skip_s),
                       _ends_from_pieces(teacher_table, teacher_ids, skip_t),
                       student_special=student_table.special[student_ids],
                       teacher_special=teacher_table.special[teacher_ids], student_ids=student_ids,
                       teacher_ids=teacher_ids, special_pairs=special_pairs)


def _encode(tokenizer: Any, text: str, byte_at: np.ndarray):
    """Ids of ``text`` (no special tokens added) and each token's byte end offset (from pieces when they
    rebuild the text exactly, else from the tokenizer's character offsets)."""
    core = backend(tokenizer)
    if core is None:
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        return ids, None
    encoding = core.encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, dtype=np.int64)
    ends = byte_at[np.asarray([end for _, end in encoding.offsets], dtype=np.int64)] if len(ids) else \
        np.zeros(0, np.int64)
    return ids, ends


def align_text(text: str, student_tokenizer: Any, teacher_tokenizer: Any, student_table: TokenTable,
               teacher_table: TokenTable, *, special_pairs: dict[int, int] | None = None):
    """Encodes ``text`` (a response) with both tokenizers and aligns the two tokenisations.

    Uses the pieces where both rebuild ``text`` exactly (byte-exact, partial characters included), else the fast
    tokenizers' character offsets (normalisers, WordPiece's dropped whitespace).

    Returns:
        ``(alignment, student_ids, teacher_ids)``: ``[n_s]`` and ``[n_t]`` int64 ids of the response.
    """
    raw = text.encode()
    byte_at = np.zeros(len(text) + 1, dtype=np.int64)  # character offset -> byte offset
    byte_at[1:] = np.cumsum([len(char.encode()) for char in text])
    student_ids, student_ends = _encode(student_tokenizer, text, byte_at)
    teacher_ids, teacher_ends = _encode(teacher_tokenizer, text, byte_at)
    exact = {student_table.text(student_ids), teacher_table.text(teacher_ids)} <= {raw, b" " + raw}
    if exact or student_ends is None or teacher_ends is None:
        return align_ids(student_ids, teacher_ids, student_table, teacher_table, special_pairs=special_pairs), \
            student_ids, teacher_ids
    student_special, teacher_special = student_table.special[student_ids], teacher_table.special[teacher_ids]
    for ends, special in ((student_ends, student_special), (teacher_ends, teacher_special)):
        if (~special).any():
            ends[np.flatnonzero(~special)[-1]] = len(raw)  # trailing whitespace one side dropped joins the last group
    alignment = align_spans(student_ends, teacher_ends, student_special=student_special,
                            teacher_special=teacher_special, student_ids=student_ids, teacher_ids=teacher_ids,
                            special_pairs=special_pairs)
    return alignment, student_ids, teacher_ids

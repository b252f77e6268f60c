"""A teacher of another tokenizer as the trainer asks it: its own tokenisation of each sample, and its rows put back
on the student's positions.

The student's sample is ids of the student's vocabulary. The teacher is sent the same *text* in its own ids (it never
sees a student id): the prompt is what the teacher would read if it served the conversation itself, by default the
conversation through the teacher's own chat template (:mod:`.cross_prompt`, ``teacher.cross_tokenizer.prompt``); the
response is the student's response text encoded on its own (so that a token boundary lies at the response start on
both sides), followed by the teacher's partner of each special token the student's response ends with (EOS with EOS).
Only responses are aligned, so the two chat templates never need to match.

:func:`megatron_gkd.xtok.align.align_ids` aligns the two responses from the bytes their ids write; where a normaliser
or a whitespace-dropping pre-tokenizer makes the bytes differ, the tokenizers' offsets into the decoded text are used
(:func:`~megatron_gkd.xtok.align.align_text`), which needs the student's ids to be its canonical tokenisation of the
text; a sampled non-canonical tokenisation that also writes other bytes is left unaligned (counted, never guessed).

The teacher's rows come back one per *teacher* response token; :meth:`CrossTokenizer.student_output` moves them to
the student's response positions:

* the head of a 1:1 or 1:n group (and a paired special token) gets the teacher's row at the group's first teacher
  token, in the teacher's ids: the same text prefix predicts both (:mod:`.align`), and the loss projects the student
  through ``W`` (X-Token's P-KL, or H-KL);
* every position of an n:1 or n:m group (the teacher's token is longer: ``"1" "2" "3"`` / ``"123"``, the numeral case
  that breaks a head-only comparison, since the teacher's mass sits on ``"123"``, not on ``"1"``) gets, with
  ``inside_groups=chain``, the **chain rule over the teacher's top-k**: the teacher's distribution at the group's first
  teacher position, restricted to the teacher tokens whose text extends the student's text so far in the group, and
  pushed onto the student token each of them continues with (the longest student token that prefixes the rest of its
  text). At the group's head that is the teacher's probability of each first student token (unnormalised, like any
  top-k row); further in, it is conditioned on the student's tokens before (normalised over the teacher's top-k tokens
  that agree with them: an estimate from a truncated distribution, exact when the top-k holds every such token).
  These rows hold *student* ids, as ``V_t + s`` (:func:`megatron_gkd.losses.cross_vocab.projection_map.with_student_columns`),
  so the same loss compares them with the student's own probabilities, without ``W``. With ``inside_groups=skip``
  the head is projected like a 1:1 head and the rest of the group gets an empty row;
* every other position (unaligned, or a row no teacher token of the top-k agrees with) gets an empty row (no id,
  log-prob ``-inf``: the loss compares nothing there and gives it no gradient).

A student that drops whitespace from its tokens (a word-level pre-tokenizer) compares texts with whitespace removed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from megatron_gkd.data import load_tokenizer
from megatron_gkd.losses.cross_vocab.projection_map import shard_projection, with_student_columns
from megatron_gkd.teacher.clients.cross_prompt import TeacherPrompts
from megatron_gkd.teacher.protocol.types import SequenceRequest, TeacherOutput
from megatron_gkd.xtok.align import Alignment, Kind, align_ids, align_spans, align_text
from megatron_gkd.xtok.config import CrossTokenizerConfig
from megatron_gkd.xtok.projection import ProjectionMap, build_projection, special_names
from megatron_gkd.xtok.tokens import TokenTable, token_table

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Translated:
    """One sample as the teacher is asked it, and how its response positions map back.

    Attributes:
        sequence: the teacher-side prompt + response.
        alignment: the student response positions' groups (:class:`~megatron_gkd.xtok.align.Alignment`); every
            position unaligned when the two tokenisations could not be matched.
        aligned: whether the response could be aligned at all.
        student_ids: ``[n_s]`` the student's response ids.
        chained: ``[n_s]`` bool, the positions compared through the chain rule (``inside_groups=chain``).
    """

    sequence: SequenceRequest
    alignment: Alignment
    aligned: bool
    student_ids: np.ndarray
    chained: np.ndarray


class CrossTokenizer:
    """The student <-> teacher tokenizer pair of one teacher: translation of samples, alignment, the map ``W``.

    Args:
        config: the teacher's ``cross_tokenizer`` section.
        student_tokenizer, teacher_tokenizer: HF tokenizers.
        student_vocab_size: rows of the student's output layer (padding rows included: they stay unmapped).
        teacher_vocab_size: rows of the teacher's output layer (default: its tokenizer's size).

    Raises:
        ValueError: a saved ``projection_map`` that belongs to another pair or is corrupted.
    """

    def __init__(self, config: CrossTokenizerConfig, student_tokenizer: Any, teacher_tokenizer: Any, *,
                 student_vocab_size: int, teacher_vocab_size: int | None = None):
        self.method, self.chain = config.method, config.inside_groups == "chain"
        self.text_boundaries = config.boundary == "text"
        self.student_tokenizer, self.teacher_tokenizer = student_tokenizer, teacher_tokenizer
        self.prompts = TeacherPrompts(config.prompt, student_tokenizer, teacher_tokenizer)  # learn() the datasets
        self.student_table: TokenTable = token_table(student_tokenizer)
        self.teacher_table: TokenTable = token_table(teacher_tokenizer)
        teacher_specials = special_names(teacher_tokenizer, self.teacher_table)
        self.special_pairs = {s: teacher_specials[name]
                              for name, s in special_names(student_tokenizer, self.student_table).items()
                              if name in teacher_specials}
        for attribute in ("eos_token_id", "bos_token_id", "pad_token_id"):  # EOS with EOS, whatever their names
            s, t = getattr(student_tokenizer, attribute, None), getattr(teacher_tokenizer, attribute, None)
            if s is not None and t is not None:
                self.special_pairs.setdefault(int(s), int(t))
        self._student_special = {t: s for s, t in sorted(self.special_pairs.items(), reverse=True)}
        teacher_vocab_size = teacher_vocab_size or self.teacher_table.vocab_size
        if config.projection_map is not None:
            self.projection = ProjectionMap.load(config.projection_map, student_digest=self.student_table.digest,
                                                 teacher_digest=self.teacher_table.digest)
            if self.projection.student_vocab_size != student_vocab_size:
                raise ValueError(f"teacher.cross_tokenizer.projection_map={config.projection_map} has "
                                 f"{self.projection.student_vocab_size} student rows, the student's output layer "
                                 f"{student_vocab_size}: rebuild it with student_vocab_size={student_vocab_size}")
        else:
            self.projection = build_projection(student_tokenizer, teacher_tokenizer,
                                               student_vocab_size=student_vocab_size,
                                               teacher_vocab_size=teacher_vocab_size, max_pieces=config.max_pieces,
                                               decay=config.decay, special_pairs=self.special_pairs)
        # The chain rule's lookups: each student text token by its bytes (the lowest id writing them), and whether
        # the student drops whitespace (then texts are compared without it).
        pieces = self.student_table.pieces
        writes = np.flatnonzero(~self.student_table.special & (self.student_table.lengths > 0))
        self._drops_space = not any(any(byte in pieces[i] for byte in b" \t\n") for i in writes)
        self._student_by_bytes: dict[bytes, int] = {}
        for i in writes:
            self._student_by_bytes.setdefault(self._norm(pieces[i]), int(i))
        self._longest = max(map(len, self._student_by_bytes), default=0)
        stats = self.projection.stats()
        logger.info("cross-tokenizer map (%s): %d student rows mapped (%d exact), %d entries, %d unmapped rows",
                    self.method, stats["mapped"], stats["exact"], stats["nnz"], stats["empty"])

    @classmethod
    def of_teacher(cls, teacher, student_tokenizer: Any, student_vocab_size: int) -> "CrossTokenizer | None":
        """The pair of ``teacher`` (a teacher config section) when it asks for cross-tokenizer distillation, its
        tokenizer read from ``teacher.tokenizer_source``; None otherwise.

        Raises:
            ValueError: the teacher's tokenizer is not known (the config's check says the same, earlier).
        """
        if not (teacher.enabled and teacher.cross_tokenizer.enabled):
            return None

        if teacher.tokenizer_source is None:
            raise ValueError("teacher.cross_tokenizer.method is set but the teacher's tokenizer is unknown: set "
                             "teacher.cross_tokenizer.tokenizer=DIR (an HF tokenizer directory)")
        return cls(teacher.cross_tokenizer, student_tokenizer, load_tokenizer(teacher.tokenizer_source),
                   student_vocab_size=student_vocab_size)

    @property
    def teacher_digest(self) -> str:
        return self.teacher_table.digest

    @property
    def teacher_vocab_size(self) -> int:
        """Teacher ids the rows may hold (the map's columns)."""
        return self.projection.teacher_vocab_size

    def shard(self, *, tp_rank: int, tp_size: int, vocab_size_local: int, device="cpu"):
        """This TP rank's rows of ``W`` for the loss (:func:`megatron_gkd.losses.shard_projection`), with the student's
        own vocabulary as extra columns when the chain rule sends student-vocabulary rows."""
        p = self.projection
        shard = shard_projection(p.student_ids, p.teacher_ids, p.weights, student_vocab_size=p.student_vocab_size,
                                 teacher_vocab_size=p.teacher_vocab_size, exact=p.exact, tp_rank=tp_rank,
                                 tp_size=tp_size, vocab_size_local=vocab_size_local, method=self.method, device=device)
        return with_student_columns(shard, self.student_table.vocab_size) if self.chain else shard

    # ------------------------------------------------------------------------------------------ requests
    def _decode(self, ids: np.ndarray) -> str:
        return self.student_tokenizer.decode(ids.tolist(), skip_special_tokens=True,
                                             clean_up_tokenization_spaces=False)

    def _encode(self, text: str, *, special: bool) -> np.ndarray:
        return np.asarray(self.teacher_tokenizer(text, add_special_tokens=special)["input_ids"], dtype=np.int64)

    def translate(self, tokens: np.ndarray, prompt_len: int) -> Translated:
        """The teacher's request for the student's ``tokens`` (prompt then response) and the response's alignment."""
        tokens = np.asarray(tokens, dtype=np.int64)
        prompt, response = tokens[:prompt_len], tokens[prompt_len:]
        special = self.student_table.special[response]
        tail = len(response) - (np.flatnonzero(~special)[-1] + 1 if (~special).any() else 0)
        body = response[: len(response) - tail]  # text (and special tokens within it) before the closing specials
        text = self._decode(body)
        teacher_prompt = self.prompts(prompt)
        closing = [self.special_pairs[int(i)] for i in response[len(body):] if int(i) in self.special_pairs]
        written = self._encode(text, special=False)
        teacher_response = np.concatenate([written, np.asarray(closing, dtype=np.int64)])
        if not len(teacher_response):  # nothing the teacher can write: one end-of-sequence row, compared nowhere
            eos = self.teacher_tokenizer.eos_token_id
            teacher_response = np.asarray([eos if eos is not None else teacher_prompt[-1]], dtype=np.int64)
        alignment, aligned = self._align(response, teacher_response, text)
        unknown = self.teacher_tokenizer.unk_token_id
        if aligned and unknown is not None and unknown in written and unknown not in body:
            # The teacher cannot spell part of the student's text (its tokenizer maps it to its unknown token): its
            # rows there and after would score a token it never learnt to read. Left unaligned, counted.
            alignment, aligned = _unaligned(len(response), len(teacher_response)), False
        sequence = SequenceRequest(token_ids=np.concatenate([teacher_prompt, teacher_response]),
                                   response_start=len(teacher_prompt))
        chained = np.isin(alignment.kind, (Kind.MANY_TO_ONE, Kind.MANY_TO_MANY)) if self.chain else \
            np.zeros(len(response), dtype=bool)
        if self.text_boundaries:  # every position the chain rule can read: all but 1:n heads and the unaligned
            chained = ~np.isin(alignment.kind, (Kind.ONE_TO_MANY, Kind.UNALIGNED))
        return Translated(sequence, alignment, aligned, response, chained)

    def _align(self, student: np.ndarray, teacher: np.ndarray, text: str) -> tuple[Alignment, bool]:
        try:  # the bytes the ids write agree (byte-level BPE, SentencePiece with byte fallback, ...)
            return align_ids(student, teacher, self.student_table, self.teacher_table,
                             special_pairs=self.special_pairs), True
        except ValueError:
            pass
        s_special, t_special = self.student_table.special[student], self.teacher_table.special[teacher]
        s_text, t_text = student[~s_special], teacher[~t_special]
        try:
            by_offsets, s_canonical, t_canonical = align_text(text, self.student_tokenizer, self.teacher_tokenizer,
                                                              self.student_table, self.teacher_table)
        except ValueError:  # the offsets do not cover the same text either
            return _unaligned(len(student), len(teacher)), False
        if not (np.array_equal(s_canonical, s_text) and np.array_equal(t_canonical, t_text)) or s_special[:len(
                s_text)].any():
            return _unaligned(len(student), len(teacher)), False
        # The text tokens' groups from the offsets, then the closing special tokens paired at the end of the text.
        ends = np.full(len(student), 0, dtype=np.int64)
        t_ends = np.full(len(teacher), 0, dtype=np.int64)
        s_ends_text = _ends_of(by_offsets, len(t_text))
        ends[: len(s_text)], t_ends[: len(t_text)] = s_ends_text
        ends[len(s_text):] = t_ends[len(t_text):] = max(int(ends[: len(s_text)].max(initial=0)),
                                                         int(t_ends[: len(t_text)].max(initial=0)))
        return align_spans(ends, t_ends, student_special=s_special, teacher_special=t_special, student_ids=student,
                           teacher_ids=teacher, special_pairs=self.special_pairs), True

    # ---------------------------------------------------------------------------------------------- rows
    def _norm(self, piece: bytes) -> bytes:
        return piece.translate(None, b" \t\n\r") if self._drops_space else piece

    def _continues_with(self, rest: bytes) -> int | None:
        """The longest student token that prefixes ``rest``, or None."""
        for length in range(min(len(rest), self._longest), 0, -1):
            found = self._student_by_bytes.get(rest[:length])
            if found is not None:
                return found
        return None

    def _continuations(self, ids: np.ndarray, logprobs: np.ndarray, prefix: bytes) -> dict[int, float]:
        """Teacher mass of the row's tokens whose text extends ``prefix``, by the student token each goes on with
        (at an empty prefix, a special token counts for its student partner)."""
        mass: dict[int, float] = {}
        for t, logprob in zip(ids.tolist(), logprobs.tolist()):
            if logprob == -math.inf:
                continue
            if self.teacher_table.special[t]:
                s = self._student_special.get(t) if not prefix else None
            else:
                text = self._norm(self.teacher_table.pieces[t])
                if len(text) <= len(prefix) or not text.startswith(prefix):
                    continue
                s = self._continues_with(text[len(prefix):])
            if s is not None:
                mass[s] = mass.get(s, 0.0) + math.exp(logprob)
        return mass

    def _across_boundary(self, output: TeacherOutput, teacher_ids: np.ndarray, position: int,
                         mass: dict[int, float]) -> dict[int, float]:
        """``boundary=text`` at a head: the teacher's row at ``position`` (``mass``, conditioned on its previous token
        having ended) mixed with the previous row's tokens that extend that token past the boundary."""
        if position < 1:
            return mass
        previous = int(teacher_ids[position - 1])
        text = self._norm(self.teacher_table.pieces[previous])
        if self.teacher_table.special[previous] or not text:
            return mass
        ended = math.exp(float(output.token_logprobs[position - 1]))
        others = output.topk_ids[position - 1] != previous
        extended = self._continuations(output.topk_ids[position - 1][others],
                                       output.topk_logprobs[position - 1][others], text)
        if not extended:
            return mass
        total = ended + sum(extended.values())
        mixed = {s: ended * m / total for s, m in mass.items()}
        for s, m in extended.items():
            mixed[s] = mixed.get(s, 0.0) + m / total
        return mixed

    def student_output(self, output: TeacherOutput, translated: Translated) -> TeacherOutput:
        """``output`` (one row per teacher response token) as rows of the student's response positions (module
        docstring): teacher ids at the heads compared through ``W``, student ids (``V_t + s``) at the chain rule's
        positions, empty rows elsewhere. ``token_logprobs`` of a position that is not a head is 0 (nothing reads it)."""
        alignment = translated.alignment
        position = np.where(translated.chained, -1, alignment.teacher_position).astype(np.int64)
        found = position >= 0
        source = np.where(found, position, 0)
        ids = np.where(found[:, None], output.topk_ids[source], 0).astype(np.int64)
        logprobs = np.where(found[:, None], output.topk_logprobs[source], -np.inf).astype(np.float32)
        tokens = np.where(found, output.token_logprobs[source], 0.0).astype(np.float32)
        hidden = None if output.hidden is None else np.where(found[:, None], output.hidden[source], 0.0).astype(
            np.float32)
        offset, pieces, width = self.teacher_vocab_size, self.student_table.pieces, ids.shape[1]
        teacher_ids = translated.sequence.response_ids
        for i in np.flatnonzero(translated.chained):
            head, teacher = int(alignment.student_start[i]), int(alignment.teacher_start[i])
            prefix = self._norm(b"".join(pieces[s] for s in translated.student_ids[head:i].tolist()))
            mass = self._continuations(output.topk_ids[teacher], output.topk_logprobs[teacher], prefix)
            if head == i and self.text_boundaries:
                mass = self._across_boundary(output, teacher_ids, teacher, mass)
            total = 1.0 if head == i else sum(mass.values())  # at the head a top-k row; further in, conditioned
            ranked = sorted(mass.items(), key=lambda item: -item[1])[:width]
            ids[i, : len(ranked)] = np.asarray([s for s, _ in ranked], dtype=np.int64) + offset
            logprobs[i, : len(ranked)] = [math.log(m / total) for _, m in ranked]
        return TeacherOutput(topk_ids=ids, topk_logprobs=logprobs, token_logprobs=tokens, hidden=hidden)


def _unaligned(num_student: int, num_teacher: int) -> Alignment:
    none = np.full(num_student, -1, dtype=np.int32)
    return Alignment(kind=np.full(num_student, Kind.UNALIGNED, dtype=np.uint8), student_start=none,
                     teacher_start=none.copy(), teacher_end=none.copy(), num_teacher=num_teacher)


def _ends_of(alignment: Alignment, num_teacher_text: int) -> tuple[np.ndarray, np.ndarray]:
    """Monotone byte-like end offsets that rebuild ``alignment``'s groups of text tokens: each group ends at its index
    (+1), on both sides (what :func:`align_spans` needs to reproduce the same groups with special tokens added)."""
    n = len(alignment.kind)
    student_group = np.zeros(n, dtype=np.int64)
    teacher_group = np.zeros(num_teacher_text, dtype=np.int64)
    group = -1
    for i in range(n):
        if alignment.student_start[i] == i:
            group += 1
            teacher_group[alignment.teacher_start[i]:alignment.teacher_end[i]] = group
        student_group[i] = group
    return student_group + 1, teacher_group + 1

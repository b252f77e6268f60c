"""The prompt a teacher of another tokenizer reads: what it would read if it served the conversation itself.

The student's prompt is a conversation rendered by the student's chat template (or raw text). A chat model reads its
turns through its own template, whose markup is special tokens (``<|im_start|>assistant\\n``): those ids are what
tell it whose turn it is. So the teacher is sent the *conversation*, rendered its own way, never the student's markup
with the special tokens dropped (the rule before issue #45: on a tiny task whose template ends in a special token
that cost 1.94 nats per token of teacher shift, and a teacher that is the same function of text as the
same-tokenizer one distilled measurably worse). :class:`TeacherPrompts` is the one owner of that prompt, for the
trainer's requests (:mod:`.cross_request`), eval's KL and the teacher cache.

=============================================  =============================================  ========================
the student's prompt                           ``prompt=template`` (default)                  ``prompt=text``
=============================================  =============================================  ========================
raw text (no chat template on the student's    the text, encoded with the special tokens the  the same, from the ids
side)                                          teacher adds itself (its BOS)
a conversation (the student's chat template)   the conversation through the teacher's own     the student's rendering
                                               chat template and generation prompt            as text, specials kept
the same, and the teacher has no template      the ``text`` rule                              (below)
ids of no loaded record                        the ``text`` rule (counted, warned once)
=============================================  =============================================  ========================

**Why ``template`` is the default.** It is exactly what the teacher reads when it serves that conversation (its
template, its special ids, its default system prompt if its template adds one), whatever the student's template
looks like: a Llama student's ``<|start_header_id|>`` means nothing to a Qwen teacher. Only responses are aligned
(:mod:`megatron_gkd.xtok.align`), so the two prompts never need to match.

**Why ``text`` is kept.** Where only ids exist (a teacher with no chat template of its own, a prompt of no loaded
record), and by choice for a teacher trained on the student's template family whose own template would add what the
student never saw. The student's prompt is decoded *with* its special tokens and re-encoded by the teacher, so every
special token whose string the teacher knows becomes the teacher's special id (``<|im_start|>`` for two ChatML
tokenizers); one it does not know is read as text. The special tokens the student's tokenizer adds to any text (its
BOS) are dropped first and the teacher adds its own.

**How a sample finds its conversation.** Samples carry only ids (rollout, the partial-rollout buffer, eval), so the
conversations are learnt from the datasets at start-up (:meth:`TeacherPrompts.learn`): the teacher's ids of each
record, by a 16-byte BLAKE2 digest of the student's prompt ids. That renders every prompt once more (the student's
loading cost again) and holds the teacher's prompt ids (4 bytes a token) plus about 120 bytes a distinct prompt.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from megatron_gkd.data import PromptRecord
from megatron_gkd.data.readers import Malformed
from megatron_gkd.data.tokenization import render_messages, tokenize_texts
from megatron_gkd.xtok.config import CrossTokenizerConfig

logger = logging.getLogger(__name__)


def teacher_chat_template(tokenizer: Any) -> str | None:
    """The chat template the teacher's tokenizer uses itself, or None when it has none.

    Raises:
        ValueError: the tokenizer holds several named templates and none is its default.
    """
    if tokenizer.chat_template is None:
        return None
    try:
        return tokenizer.get_chat_template()
    except ValueError as error:
        raise ValueError(f"the teacher's tokenizer: {error}; set teacher.cross_tokenizer.prompt=text to send the "
                         "student's rendering instead") from error


def prompt_rule(config: CrossTokenizerConfig, teacher_tokenizer: Any) -> str:
    """What decides the teacher's prompts, for a teacher cache's manifest: ``template:<sha256 of the teacher's
    template, 16 hex>`` or ``text`` (``template`` with a teacher that has no template reads as ``text``)."""
    return _describe(teacher_chat_template(teacher_tokenizer) if config.prompt == "template" else None)


def _describe(template: str | None) -> str:
    return "text" if template is None else "template:" + hashlib.sha256(template.encode()).hexdigest()[:16]


def _key(prompt_ids) -> bytes:
    return hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=16).digest()


def _added_around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids ``tokenizer`` adds before and after any text (its BOS, sometimes an EOS)."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    return [], []


class TeacherPrompts:
    """The teacher's prompt for each student prompt (module docstring).

    Args:
        rule: ``template`` or ``text`` (``teacher.cross_tokenizer.prompt``).
        student_tokenizer, teacher_tokenizer: HF tokenizers.
    """

    def __init__(self, rule: str, student_tokenizer: Any, teacher_tokenizer: Any):
        self.student_tokenizer, self.teacher_tokenizer = student_tokenizer, teacher_tokenizer
        self.template = teacher_chat_template(teacher_tokenizer) if rule == "template" else None
        self.rule = "template" if self.template is not None else "text"  # no template of its own: the text rule
        self._lead, self._trail = _added_around(student_tokenizer)
        self._index: dict[bytes, int] = {}  # the student's prompt digest -> row of the teacher's ids below
        self._ids = np.zeros(0, dtype=np.int32)
        self._offsets = np.zeros(1, dtype=np.int64)
        self.num_missed = 0
        if rule == "template" and self.template is None:
            logger.warning("teacher.cross_tokenizer.prompt=template: the teacher's tokenizer has no chat template, so "
                           "a prompt the student's chat template rendered is sent as that rendering with its special "
                           "tokens kept (the text rule)")

    @property
    def description(self) -> str:
        """:func:`prompt_rule` of this teacher."""
        return _describe(self.template)

    def __len__(self) -> int:
        """Prompts learnt."""
        return len(self._index)

    def learn(self, records: Iterable[PromptRecord]) -> None:
        """Renders the conversation of each of ``records`` (loaded with ``keep_conversations``) the teacher's way
        and keeps its ids by the student's prompt ids. A no-op with the ``text`` rule.

        Raises:
            ValueError: the teacher's template cannot render some conversations (their rows and the first error
                named); or records without conversations.
        """
        if self.rule == "text":
            return
        raw, chats = [], []
        for record in records:
            if record.conversation is None:
                raise ValueError(f"prompt row {record.index} has no conversation: load the data with "
                                 "keep_conversations=True for a teacher of another tokenizer with prompt=template")
            if _key(record.prompt_ids) not in self._index:
                (raw if isinstance(record.conversation, str) else chats).append(record)
        rendered = [render_messages(r.conversation, self.template, self.teacher_tokenizer) for r in chats]
        failed = [(r.index, m.detail or m.reason) for r, m in zip(chats, rendered) if isinstance(m, Malformed)]
        if failed:
            raise ValueError(f"the teacher's chat template cannot render {len(failed)} of {len(chats)} conversations "
                             f"(row {failed[0][0]}: {failed[0][1]}); fix those records, or set "
                             "teacher.cross_tokenizer.prompt=text to send the student's rendering instead")
        # Raw text gets the specials the teacher adds itself; a template writes its own (adding them would double BOS).
        ids = (tokenize_texts(self.teacher_tokenizer, [r.conversation for r in raw], add_special_tokens=True)
               + tokenize_texts(self.teacher_tokenizer, rendered, add_special_tokens=False))
        self._add([r.prompt_ids for r in raw + chats], ids)

    def _add(self, prompts: list, teacher_ids: list[list[int]]) -> None:
        rows, conflicts, kept = len(self._index), 0, []
        for prompt, ids in zip(prompts, teacher_ids, strict=True):
            key = _key(prompt)
            row = self._index.get(key)
            if row is None:
                self._index[key] = rows + len(kept)
                kept.append(ids)
            elif (kept[row - rows] if row >= rows else self._row(row).tolist()) != ids:
                conflicts += 1  # two conversations the student renders alike (its template drops what differs)
        if conflicts:
            logger.warning("%d conversations render to the same prompt for the student but not for the teacher (the "
                           "student's template drops what tells them apart); the teacher reads the first of each",
                           conflicts)
        lengths = np.fromiter((len(ids) for ids in kept), dtype=np.int64, count=len(kept))
        self._offsets = np.concatenate([self._offsets, self._offsets[-1] + np.cumsum(lengths)])
        self._ids = np.concatenate([self._ids, np.fromiter((i for ids in kept for i in ids), dtype=np.int32,
                                                           count=int(lengths.sum()))])
        logger.info("teacher prompts: %d learnt (%d tokens)", len(self), len(self._ids))

    def _row(self, row: int) -> np.ndarray:
        return self._ids[self._offsets[row]:self._offsets[row + 1]].astype(np.int64)

    def __call__(self, prompt: np.ndarray) -> np.ndarray:
        """``[p_t]`` the teacher's prompt ids for the student's ``prompt`` (``[p]`` ids); never empty."""
        found = self._index.get(_key(prompt)) if self.rule == "template" else None
        if found is not None:
            ids = self._row(found)
        else:
            if self.rule == "template":
                self.num_missed += 1
                if self.num_missed == 1:
                    logger.warning("a prompt of no loaded record reached a teacher of another tokenizer: it reads the "
                                   "student's rendering with its special tokens kept (the text rule); "
                                   "TeacherPrompts.num_missed counts them")
            ids = self.from_ids(prompt)
        if not len(ids):  # an empty prompt text: the teacher needs one token of context
            first = self.teacher_tokenizer.bos_token_id or self.teacher_tokenizer.eos_token_id or 0
            ids = np.asarray([first], dtype=np.int64)
        return ids

    def from_ids(self, prompt: np.ndarray) -> np.ndarray:
        """The ``text`` rule: the student's prompt decoded with its special tokens kept (those its tokenizer adds to
        any text dropped) and encoded by the teacher with the ones it adds itself."""
        ids = np.asarray(prompt).tolist()
        if self._lead and ids[:len(self._lead)] == self._lead:
            ids = ids[len(self._lead):]
        if self._trail and ids[len(ids) - len(self._trail):] == self._trail:
            ids = ids[:len(ids) - len(self._trail)]
        text = self.student_tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return np.asarray(self.teacher_tokenizer(text, add_special_tokens=True)["input_ids"], dtype=np.int64)

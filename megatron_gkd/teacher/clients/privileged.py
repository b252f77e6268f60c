"""The prompt a self-teacher reads: the student's own prompt with privileged context (issue #50 item 1, OPSD).

In on-policy self-distillation the teacher is the student's own model reading what the student does not see (the
reference solution, a hint, tool results). ``teacher.privileged_template`` is a format string over a record's fields,
e.g. ``"Reference solution: {response}\\n\\n{prompt}"``; ``{prompt}`` is the record's own prompt text (the last user
message of a conversation).

**How it composes with a chat template.** The rendered text takes the place of the prompt's *text*, never of its
markup: with a chat template it becomes the content of the conversation's last user message and the conversation is
rendered by the same template, generation prompt included; without one it is the raw prompt. So both prompts end
with the same assistant markup, and the response ids are appended unchanged: row t of the teacher's outputs
predicts the same response token t as the student's row t (:meth:`PrivilegedPrompts.sequence`).

**How a sample finds its privileged prompt.** Samples carry ids only, so the privileged prompt ids of each record are
learnt beside the student's, keyed by a 16-byte BLAKE2 digest of the student's prompt ids (as
:mod:`megatron_gkd.teacher.clients.cross_prompt` keys a teacher of another tokenizer). A sample whose prompt is not known is
refused, never scored on its own prompt: that would be a silent teacher equal to the student.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from megatron_gkd.data import PromptRecord
from megatron_gkd.data.readers import Malformed
from megatron_gkd.data.tokenization import render_messages, tokenize_texts
from megatron_gkd.teacher.protocol.types import SequenceRequest

TEMPLATE_KEY = "teacher.privileged_template"


def template_fields(template: str) -> list[str]:
    """The record fields ``template`` reads, in order of first use.

    Raises:
        ValueError: the template is not a format string of plain field names (naming ``teacher.privileged_template``),
            or reads no field at all.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise ValueError(f"{TEMPLATE_KEY}={template!r} is not a format string: {error}; write literal braces as "
                         "{{ and }}") from error
    fields: list[str] = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"{TEMPLATE_KEY}={template!r} reads {{{name}}}: fields are plain record field names, "
                             "e.g. {response} or {prompt}")
        if name not in fields:
            fields.append(name)
    if not fields:
        raise ValueError(f"{TEMPLATE_KEY}={template!r} reads no field of the record: the teacher would see no "
                         "privileged context; e.g. \"Reference solution: {response}\\n\\n{prompt}\"")
    return fields


def render_privileged(template: str, fields: Mapping[str, object]) -> str:
    """``template`` over one record's ``fields``.

    Raises:
        ValueError: a field the template reads is missing or null in the record (naming it and the fields there are).
    """
    values = {}
    for name in template_fields(template):
        value = fields.get(name)
        if value is None:
            raise ValueError(f"{TEMPLATE_KEY} reads {{{name}}}, which this record does not have (it has "
                             f"{', '.join(sorted(k for k, v in fields.items() if v is not None)) or 'no fields'})")
        values[name] = value
    return template.format_map(values)


def privileged_conversation(conversation: str | Sequence[Mapping[str, str]], text: str) -> str | list[dict[str, str]]:
    """The conversation the self-teacher reads: ``text`` (:func:`render_privileged`) as the raw prompt, or as the
    content of the last user message of a chat conversation (the other turns kept).

    Raises:
        ValueError: a chat conversation with no user message.
    """
    if isinstance(conversation, str):
        return text
    messages = [dict(message) for message in conversation]
    users = [i for i, message in enumerate(messages) if message.get("role") == "user"]
    if not users:
        raise ValueError(f"{TEMPLATE_KEY}: the conversation has no user message to put the privileged context in")
    messages[users[-1]]["content"] = text
    return messages


def prompt_key(prompt_ids: Sequence[int] | np.ndarray) -> bytes:
    """The key of a student prompt: BLAKE2 (16 bytes) of its ids as int64."""
    return hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=16).digest()


class PrivilegedPrompts:
    """The self-teacher's prompt ids of each student prompt, and the teacher's view of a scored sequence."""

    def __init__(self):
        self._ids: dict[bytes, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, student_prompt_ids: Sequence[int], teacher_prompt_ids: Sequence[int]) -> None:
        """Records the teacher's prompt of one student prompt (the same student prompt twice keeps the first)."""
        if len(teacher_prompt_ids) == 0:
            raise ValueError(f"{TEMPLATE_KEY} rendered an empty prompt: the teacher needs at least one token")
        self._ids.setdefault(prompt_key(student_prompt_ids), np.asarray(teacher_prompt_ids, dtype=np.int64))

    def sequence(self, sequence: SequenceRequest) -> SequenceRequest:
        """``sequence`` with its prompt replaced by the privileged one; the response ids (and TCAD's requested ids)
        are the same, so the outputs' rows are the student's rows.

        Raises:
            KeyError: the prompt is not known (no record of the loaded datasets has it).
        """
        start = sequence.response_start
        teacher = self._ids.get(prompt_key(sequence.token_ids[:start]))
        if teacher is None:
            raise KeyError(f"no privileged prompt for a prompt of {start} tokens: the self-teacher learns them from "
                           "the loaded datasets' records, and this one is in none")
        return SequenceRequest(token_ids=np.concatenate([teacher, sequence.token_ids[start:]]),
                               response_start=len(teacher), requested_ids=sequence.requested_ids)


def record_fields(record: PromptRecord, tokenizer: Any) -> dict[str, str | None]:
    """The fields a template reads of ``record`` (loaded with ``keep_conversations``): ``prompt``, the prompt's text
    (a conversation's last user message); ``response``, the reference response decoded from its ids (its EOS
    dropped), or None; ``answer``, or None.

    Raises:
        ValueError: the record has no conversation (the data was loaded without ``keep_conversations``).
    """
    conversation = record.conversation
    if conversation is None:
        raise ValueError(f"prompt row {record.index} has no conversation: the self teacher needs the data loaded with "
                         "keep_conversations=True")
    if isinstance(conversation, str):
        prompt = conversation
    else:
        prompt = next((m["content"] for m in reversed(conversation) if m.get("role") == "user"), None)
    response = None
    if record.response_ids is not None:
        response = tokenizer.decode(list(record.response_ids[:-1]), skip_special_tokens=False)
    return {"prompt": prompt, "response": response, "answer": record.answer}


def learn_privileged(prompts: PrivilegedPrompts, records: Iterable[PromptRecord], template: str, tokenizer: Any,
                     chat_template: str | None) -> None:
    """Adds the privileged prompt of each of ``records`` to ``prompts``: ``template`` over the record's fields
    (:func:`record_fields`), in place of the prompt's text, rendered as the student's prompt was (``chat_template``:
    the student's, or None for raw text) and tokenized by the student's tokenizer.

    Raises:
        ValueError: a record lacks a field the template reads, or the chat template cannot render one (the row named).
    """
    keys, texts = [], []
    for record in records:
        try:
            text = render_privileged(template, record_fields(record, tokenizer))
            conversation = privileged_conversation(record.conversation, text)
        except ValueError as error:
            raise ValueError(f"prompt row {record.index}: {error}") from error
        if chat_template is not None:
            conversation = render_messages(conversation, chat_template, tokenizer)
            if isinstance(conversation, Malformed):
                raise ValueError(f"prompt row {record.index}: the chat template cannot render the privileged prompt "
                                 f"({conversation.detail or conversation.reason})")
        keys.append(record.prompt_ids)
        texts.append(conversation)
    # A chat template writes its own special tokens; raw text gets the tokenizer's, as the student's prompt did.
    for student_ids, teacher_ids in zip(keys, tokenize_texts(tokenizer, texts, add_special_tokens=chat_template is None),
                                        strict=True):
        prompts.add(student_ids, teacher_ids)

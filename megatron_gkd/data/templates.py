"""Whether a teacher would write a conversation as the student's chat template writes it.

The teacher scores what the student's template renders (its ids, or the same text in its own ids across
tokenizers); it never applies its own template. A teacher whose template writes the turns otherwise reads a prompt
format it was not trained on. :func:`compare_renderings` renders :data:`SAMPLE_CONVERSATIONS` with both templates and
takes each rendering apart into what the response depends on:

- the **opening** of the assistant's turn (what ``add_generation_prompt`` appends), which the response follows;
- the **end** of an assistant turn (what follows its content), which the student's stop token must be;
- the rest (system prompt, earlier turns).

The caller decides what a difference costs (``megatron_gkd.config.checkpoints``).
"""

from __future__ import annotations

import dataclasses

import jinja2

SAMPLE_CONVERSATIONS = (
    ({"role": "user", "content": "What is 2 + 3?"},),
    ({"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a prime number."},
     {"role": "assistant", "content": "Seven."}, {"role": "user", "content": "And an even one?"}),
)
_MARK = "MEGATRON_GKD_RESPONSE"  # an assistant message's content, found again to cut the turn's end
_REFUSALS = (jinja2.TemplateError, ValueError, TypeError)  # a template's raise_exception is a jinja2 TemplateError


@dataclasses.dataclass(frozen=True, slots=True)
class Rendering:
    """One template's renderings of :data:`SAMPLE_CONVERSATIONS`."""

    prompts: tuple[str, ...]
    """Each conversation with the assistant's opening, as the model reads a prompt."""
    opening: str | None
    """What opens the assistant's turn (None: the template rewrites the conversation when asked for it)."""
    end: str | None
    """What ends an assistant turn (None: the template drops the assistant's content)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TemplateDifference:
    """Where a teacher's rendering differs from the student's (all False: they render alike)."""

    opening: bool
    end: bool
    prompts: bool
    student: Rendering
    teacher: Rendering

    @property
    def any(self) -> bool:
        return self.opening or self.end or self.prompts

    def first_prompts(self) -> tuple[str, str]:
        """The first sample conversation the two render otherwise, as ``(student's, teacher's)``."""
        pairs = zip(self.student.prompts, self.teacher.prompts)
        return next(((s, t) for s, t in pairs if s != t), (self.student.prompts[0], self.teacher.prompts[0]))


def _render(tokenizer, template: str, messages, *, opening: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), chat_template=template, tokenize=False,
                                         add_generation_prompt=opening)


def render(tokenizer, template: str) -> Rendering:
    """``template`` (with ``tokenizer``'s special tokens) on :data:`SAMPLE_CONVERSATIONS`. A later conversation the
    template refuses (some templates raise on a system message) is kept as ``"<refused: reason>"``.

    Raises:
        ValueError: the template does not render the first conversation, a single user message.
    """
    first = SAMPLE_CONVERSATIONS[0]
    try:
        prompts = [_render(tokenizer, template, first, opening=True)]
        closed = _render(tokenizer, template, first, opening=False)
        answered = _render(tokenizer, template, (*first, {"role": "assistant", "content": _MARK}), opening=False)
    except _REFUSALS as error:
        raise ValueError(f"the chat template does not render a single user message: {error}") from error
    for messages in SAMPLE_CONVERSATIONS[1:]:
        try:
            prompts.append(_render(tokenizer, template, messages, opening=True))
        except _REFUSALS as error:
            prompts.append(f"<refused: {error}>")
    opening = prompts[0][len(closed):] if prompts[0].startswith(closed) else None
    end = answered[answered.rindex(_MARK) + len(_MARK):] if _MARK in answered else None
    return Rendering(prompts=tuple(prompts), opening=opening, end=end)


def compare_renderings(student_tokenizer, student_template: str, teacher_tokenizer,
                       teacher_template: str) -> TemplateDifference:
    """How the teacher's template renders the samples against the student's, each with its own tokenizer.

    Raises:
        ValueError: a template does not render a single user message.
    """
    student, teacher = render(student_tokenizer, student_template), render(teacher_tokenizer, teacher_template)
    return TemplateDifference(opening=student.opening != teacher.opening, end=student.end != teacher.end,
                              prompts=student.prompts != teacher.prompts, student=student, teacher=teacher)

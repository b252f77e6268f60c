"""An answer found in free text: what the ``exact_match``, ``contains`` and ``regex`` scorers compare.

A model that answers in a sentence ("The capital of France is Paris.", "So the answer is **42**.") is right, but
equal to its reference answer only after reading. Three readings, from strict to lenient:

| function | 1.0 when |
|---|---|
| :func:`exact_match` | the whole response is the answer, up to surrounding and repeated whitespace |
| :func:`contains` | the answer stands in the response as a whole word or number (case and whitespace free) |
| :class:`AnswerPattern` | the user's regular expression matches, with the answer in it or in a capture group |

All three compare text; to compare numbers by value (``1,234`` and ``1234.0``) use
:func:`~megatron_gkd.rewards.answers.math_answer`. None raises on any response: a response without the answer
scores 0.
"""

from __future__ import annotations

import re

PLACEHOLDER = "{answer}"
GROUP = "answer"

_WHITESPACE = re.compile(r"\s+")
# Sentence punctuation and Markdown emphasis around an answer are not part of it ("**42**.", "`Paris`").
_AROUND = " \t\n\r.,;:!?*_`\"'"


def _collapse(text: str) -> str:
    return _WHITESPACE.sub(" ", text).strip()


def exact_match(response: str, answer: str) -> float:
    """1 when the response equals the answer up to surrounding and repeated whitespace."""
    return float(_collapse(response) == _collapse(answer))


def core(text: str) -> str:
    """``text`` without surrounding whitespace, sentence punctuation and Markdown emphasis, whitespace runs made
    one space: ``" **Paris**. "`` reads ``"Paris"``."""
    return _collapse(text.strip(_AROUND))


def answer_regex(answer: str) -> str:
    """A regular expression that finds ``answer`` as :func:`contains` does.

    What is normalised, and why:

    * the answer's surrounding punctuation and emphasis are dropped (:func:`core`): a reference ``"Paris."`` is
      found in "Paris is the capital";
    * case is ignored (``re.IGNORECASE``, scoped to the answer): "PARIS" and "paris" are the same answer;
    * any run of whitespace matches any run: "New York" is found across a line break.

    What is not a match, and why: the answer must be whole. Where it starts or ends with a letter, digit or
    ``_``, the character beside it must not be one ("Paris" is not in "Parisian", "12" not in "125" or "x12").
    Where it starts or ends with a digit, it must not continue a longer number either: not after ``-`` or a
    Unicode minus ("-12" is another number), not after a digit and ``.`` or ``,`` ("3.12", "1,12"), not before
    ``.`` or ``,`` and a digit ("12.5", "12,000"). A full stop or comma that ends a sentence still counts:
    "It is 12." contains "12".
    """
    text = core(answer)
    body = r"\s+".join(re.escape(word) for word in text.split(" "))
    before = after = ""
    if re.match(r"\w", text[:1]):
        before = r"(?<!\w)"
    if text[:1].isdigit():
        before += r"(?<![-\u2212])(?<!\d[.,])"
    if re.match(r"\w", text[-1:]):
        after = r"(?!\w)"
    if text[-1:].isdigit():
        after += r"(?![.,]\d)"
    return f"{before}(?i:{body}){after}"


def contains(response: str, answer: str) -> float:
    """1 when the answer stands in the response as a whole word or number (see :func:`answer_regex` for what is
    normalised and what is not a match), else 0; an empty answer is found nowhere.

    Lenient by design: a response that lists several candidates ("Lyon or Paris") contains each of them.
    """
    if not core(answer):
        return 0.0
    return float(re.search(answer_regex(answer), response) is not None)


class AnswerPattern:
    """The user's regular expression, in one of three forms (the pattern itself says which):

    | pattern | 1.0 when | example |
    |---|---|---|
    | with ``{answer}`` | it is found, ``{answer}`` standing for the answer as :func:`contains` finds it | ``is:? {answer}`` |
    | with ``(?P<answer>...)`` | its last match's group is the answer (:func:`core` of both, any case) | ``\\*\\*(?P<answer>.+?)\\*\\*`` |
    | neither | it is found (a format check; no answer is read) | ``(?s)<think>.+</think>`` |

    The last match, because a model states its final answer last. Flags are inline (``(?i)``, ``(?s)``).

    Args:
        pattern: the regular expression.

    Raises:
        ValueError: the pattern does not compile, or has both ``{answer}`` and a group named ``answer``.
    """

    def __init__(self, pattern: str):
        self.pattern = pattern
        substituted = PLACEHOLDER in pattern
        try:  # with {answer} as some answer, so that a pattern that breaks only once substituted fails here
            self.compiled = re.compile(pattern.replace(PLACEHOLDER, answer_regex("0")))
        except re.error as error:
            once = f" once {PLACEHOLDER} stands for an answer (an expression of its own: not inside [...])" if substituted else ""
            raise ValueError(f"{pattern!r} is not a regular expression{once}: {error}") from None
        captures = GROUP in self.compiled.groupindex
        if substituted and captures:
            raise ValueError(f"{pattern!r} has both {PLACEHOLDER} and a group (?P<{GROUP}>...): use one, the answer "
                             "goes either into the pattern or is read from the group")
        self.substituted, self.captures = substituted, captures

    @property
    def reads_answer(self) -> bool:
        """The score depends on the reference answer (records must hold one)."""
        return self.substituted or self.captures

    def __call__(self, response: str, answer: str | None = None) -> float:
        if not self.reads_answer:
            return float(self.compiled.search(response) is not None)
        if answer is None or not core(answer):
            return 0.0
        if self.substituted:
            return float(re.search(self.pattern.replace(PLACEHOLDER, answer_regex(answer)), response) is not None)
        matches = list(self.compiled.finditer(response))
        given = matches[-1].group(GROUP) if matches else None
        return float(given is not None and re.fullmatch(answer_regex(answer), core(given)) is not None)

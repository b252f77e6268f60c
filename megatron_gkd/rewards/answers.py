"""Reading a response's final answer and comparing it with a reference: shared by the eval scorers and
the reward verifiers, so that an eval's accuracy and a training reward agree on what a right answer is.

Two conventions are read:

| marker | example | where it comes from |
|---|---|---|
| ``#### answer`` (the last one) | ``2 3 4 #### 4 3 2`` | GSM8K's solutions; the demo's arithmetic task |
| ``\\boxed{answer}`` (the last one) | ``so \\boxed{-\\frac{1}{2}}`` | MATH-style solutions |

:func:`final_answer` is the demo's exact match (whitespace removed: the demo's tokenizer spells a number one
digit per token, with spaces between the digits); :func:`math_answer` reads either marker and compares numbers
with a tolerance (``1,234``, ``-5``, ``\\frac{3}{4}``, ``50%``), falling back to text when either side is not a
number. Neither raises on any string: a response without an answer scores 0.
"""

from __future__ import annotations

import math
import re

MARKER = "####"
BOXED = "\\boxed"

_WHITESPACE = re.compile(r"\s+")
# A decimal with optional thousands separators: "1,234.5", "-7", ".5". Commas must group by three, so
# "1,2" is not read as 12 (it may be a list, or a decimal comma).
_DECIMAL = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)")
# LaTeX wrappers that do not change a number's value: \text{...}/\mathrm{...} units are dropped.
_LATEX_DROP = re.compile(r"\\(?:text|mathrm|mbox)\{[^{}]*\}|\\[,!;: ]|\\left|\\right|\\\$|\$|\\%|%|\{,\}")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def _squash(text: str) -> str:
    return _WHITESPACE.sub("", text)


def final_answer(response: str, answer: str) -> float:
    """1 when the text after the response's last ``####`` (the GSM8K convention: a worked solution, then
    the marker, then the answer) equals the answer with all whitespace removed, which a tokenizer that
    spells a number one digit per token puts between the digits; 0 without a marker.

    This is the demo's scorer (``eval.scorer=final_answer``) and the ``final_answer`` reward.
    """
    _, marker, tail = response.rpartition(MARKER)
    if not marker:
        return 0.0
    return float(_squash(tail) == _squash(answer))


def after_marker(text: str) -> str | None:
    """The first non-empty line after the last ``####`` (GSM8K puts nothing after it; a model may), or None."""
    _, marker, tail = text.rpartition(MARKER)
    if not marker:
        return None
    lines = [line for line in tail.splitlines() if line.strip()]
    return lines[0].strip() if lines else ""


def last_boxed(text: str) -> tuple[int, str] | None:
    """``(position, content)`` of the last ``\\boxed{...}`` with balanced braces (``\\boxed 5`` too), or None."""
    start = text.rfind(BOXED)
    while start >= 0:
        rest = text[start + len(BOXED):]
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            depth = 0
            for i, char in enumerate(stripped):
                depth += {"{": 1, "}": -1}.get(char, 0)
                if depth == 0:
                    return start, stripped[1:i]
        elif rest[:1] == " " and stripped:
            return start, stripped.split()[0].rstrip(".$")
        start = text.rfind(BOXED, 0, start)  # unbalanced: an earlier, complete one may still be the answer
    return None


def extract_math_answer(text: str) -> str | None:
    """The answer written last, after ``####`` or inside ``\\boxed{}`` (whichever comes later), or None."""
    boxed = last_boxed(text)
    marker = text.rfind(MARKER)
    if boxed is not None and boxed[0] > marker:
        return boxed[1]
    return after_marker(text)


def parse_number(text: str) -> float | None:
    """The value of a written number, or None when ``text`` is not exactly one.

    Reads signs (also the Unicode minus), thousands separators, decimals, ``a/b`` and ``\\frac{a}{b}``,
    ``$`` and ``%`` signs and ``\\text{}`` units, with whitespace anywhere (digits spelled one per token);
    a trailing full stop is ignored. Anything else (``3x``, ``1,2``, ``x = 3``) is not a number.
    """
    cleaned = _FRAC.sub(r"\1/\2", _LATEX_DROP.sub("", text.replace("\u2212", "-")))
    cleaned = _squash(cleaned).rstrip(".")
    if cleaned.count("/") == 1:
        numerator, denominator = (_decimal(part) for part in cleaned.split("/"))
        if numerator is None or not denominator:  # None, or a zero denominator
            return None
        return numerator / denominator
    return _decimal(cleaned)


def _decimal(text: str) -> float | None:
    if not _DECIMAL.fullmatch(text):
        return None
    value = float(text.replace(",", ""))
    return value if math.isfinite(value) else None


def math_answer(response: str, answer: str, tolerance: float = 1e-6) -> float:
    """1 when the response's last ``####`` / ``\\boxed{}`` answer equals the reference answer, else 0.

    The reference may be a bare answer or a whole solution ending in either marker (GSM8K's ``answer``
    field). Two numbers are equal when ``|given - expected| <= tolerance * max(1, |expected|)``; otherwise
    the answers are compared as text with whitespace and ``$`` removed. A response without a marker scores 0.

    Args:
        response: the model's response text.
        answer: the reference answer (or solution).
        tolerance: relative tolerance (absolute below 1).
    """
    given = extract_math_answer(response)
    if not given:
        return 0.0
    expected = extract_math_answer(answer)
    expected = answer if expected is None else expected
    given_value, expected_value = parse_number(given), parse_number(expected)
    if given_value is not None and expected_value is not None:
        return float(abs(given_value - expected_value) <= tolerance * max(1.0, abs(expected_value)))
    plain = lambda text: _squash(text).replace("$", "").rstrip(".")  # noqa: E731
    return float(plain(given) == plain(expected))

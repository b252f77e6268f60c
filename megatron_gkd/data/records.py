"""Checks one record's fields and splits it into prompt, reference response and reference answer."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_gkd.data.readers import Fields, Malformed

ROLES = ("system", "user", "assistant", "tool")

# Hints for the loading error when one reason dominates: what the user most likely has to change.
HINTS = {
    "no prompt": "set data.prompt_key / data.messages_key to the field that holds the prompts",
    "prompt and messages both set": "set data.prompt_key=null or data.messages_key=null to read only one of them",
    "no response": "the off_policy and sft modes need a reference response in data.response_key or as the "
                   "last (assistant) message",
    "chat template error": "check the chat template (data.chat_template) against these messages",
    "answer not a string": "reference answers must be strings or integers",
    "group not a string": "the field named by data.group_key must hold strings or integers",
}


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedRecord:
    """A record's content before tokenization: exactly one of ``text`` and ``messages`` is set."""

    index: int
    text: str | None
    messages: list[dict[str, str]] | None
    response: str | None
    answer: str | None
    group: str | None = None


def parse_record(index: int, row: dict[str, Any], fields: Fields, *,
                 require_responses: bool) -> ParsedRecord | Malformed:
    """Validates the fields of row ``index``.

    A ``messages`` list whose last message is from the assistant gives the reference response when the
    record has no ``response`` field; the messages before it are the prompt. Messages keep only their
    role and content, whichever reader produced them.
    """
    text = row.get(fields.prompt) if fields.prompt else None
    messages = row.get(fields.messages) if fields.messages else None
    response = row.get(fields.response)
    if text is not None and messages is not None:
        return Malformed("prompt and messages both set", f"fields {fields.prompt!r} and {fields.messages!r}")
    if text is None and messages is None:
        wanted = " or ".join(repr(name) for name in (fields.prompt, fields.messages) if name)
        return Malformed("no prompt", f"no field {wanted}")
    if text is not None:
        if not isinstance(text, str):
            return Malformed("prompt not a string", f"{fields.prompt!r} is a {type(text).__name__}")
        if not text.strip():
            return Malformed("empty prompt")
    else:
        checked = _check_messages(messages, fields.messages)
        if isinstance(checked, Malformed):
            return checked
        messages = checked
        if response is None and messages[-1]["role"] == "assistant":
            response = messages.pop()["content"]
        if not messages:
            return Malformed("empty messages", "only an assistant response, no prompt before it")
    if response is not None:
        if not isinstance(response, str):
            return Malformed("response not a string", f"{fields.response!r} is a {type(response).__name__}")
        if not response.strip():
            return Malformed("empty response")
    elif require_responses:
        return Malformed("no response", f"no field {fields.response!r} and no final assistant message")
    answer = row.get(fields.answer)
    # Integers are common in math sets and convert without loss; floats would not (3.0 vs "3").
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    elif answer is not None and not isinstance(answer, str):
        return Malformed("answer not a string", f"{fields.answer!r} is a {type(answer).__name__}")
    group = row.get(fields.group) if fields.group else None
    if isinstance(group, int) and not isinstance(group, bool):
        group = str(group)
    elif group is not None and not isinstance(group, str):
        return Malformed("group not a string", f"{fields.group!r} is a {type(group).__name__}")
    return ParsedRecord(index=index, text=text, messages=messages, response=response, answer=answer, group=group)


def _check_messages(messages: Any, key: str) -> list[dict[str, str]] | Malformed:
    if not isinstance(messages, list):
        return Malformed("messages not a list", f"{key!r} is a {type(messages).__name__}")
    if not messages:
        return Malformed("empty messages")
    checked = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return Malformed("bad message", f"message {number} is not {{'role': str, 'content': str}}")
        if message.get("role") not in ROLES:
            return Malformed("bad role", f"message {number} has role {message.get('role')!r}; expected one of "
                                         f"{list(ROLES)}")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked

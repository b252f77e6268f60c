"""The self-teacher's privileged prompt (issue #50 item 1): the template over a record's fields, how it sits in a
chat conversation, and the teacher's view of a scored sequence (same response ids, so the rows align)."""

import numpy as np
import pytest

from megatron_gkd.teacher.privileged import (
    PrivilegedPrompts,
    privileged_conversation,
    render_privileged,
    template_fields,
)
from megatron_gkd.teacher.types import SequenceRequest

TEMPLATE = "Reference solution: {response}\n\n{prompt}"


def test_template_reads_the_record_fields():
    assert template_fields(TEMPLATE) == ["response", "prompt"]
    assert render_privileged(TEMPLATE, {"prompt": "2+2?", "response": "4", "answer": None}) == \
        "Reference solution: 4\n\n2+2?"
    assert render_privileged("{{literal}} {hint}", {"hint": "h"}) == "{literal} h"


@pytest.mark.parametrize("template, message", [
    ("no fields at all", "reads no field"),
    ("{response.text}", "plain record field names"),
    ("{0}", "plain record field names"),
    ("{response", "not a format string"),
])
def test_bad_templates_are_refused_naming_the_key(template, message):
    with pytest.raises(ValueError, match=message) as caught:
        template_fields(template)
    assert "teacher.privileged_template" in str(caught.value)


def test_a_missing_field_is_named_with_the_fields_there_are():
    with pytest.raises(ValueError, match=r"reads \{response\}.*it has answer, prompt"):
        render_privileged(TEMPLATE, {"prompt": "p", "answer": "a", "response": None})


def test_the_context_replaces_the_text_of_the_last_user_message():
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
                    {"role": "assistant", "content": "ok"}, {"role": "user", "content": "2+2?"}]
    got = privileged_conversation(conversation, "Reference solution: 4\n\n2+2?")
    assert got[:3] == conversation[:3] and got[3] == {"role": "user", "content": "Reference solution: 4\n\n2+2?"}
    assert conversation[3]["content"] == "2+2?"  # the student's conversation is not changed
    assert privileged_conversation("2+2?", "ctx 2+2?") == "ctx 2+2?"
    with pytest.raises(ValueError, match="no user message"):
        privileged_conversation([{"role": "system", "content": "s"}], "x")


def test_the_teacher_sequence_keeps_the_response_and_requested_ids():
    prompts = PrivilegedPrompts()
    prompts.add([5, 6, 7], [9, 9, 5, 6, 7])
    prompts.add([5, 6, 7], [1, 2])  # the first one is kept
    requested = np.arange(6).reshape(2, 3)
    got = prompts.sequence(SequenceRequest(token_ids=[5, 6, 7, 30, 31], response_start=3, requested_ids=requested))
    np.testing.assert_array_equal(got.token_ids, [9, 9, 5, 6, 7, 30, 31])
    assert got.response_start == 5 and got.num_response_tokens == 2
    np.testing.assert_array_equal(got.requested_ids, requested)
    assert len(prompts) == 1


def test_an_unknown_prompt_is_refused_not_scored_on_its_own_prompt():
    prompts = PrivilegedPrompts()
    prompts.add([5, 6, 7], [9, 5, 6, 7])
    with pytest.raises(KeyError, match="no privileged prompt"):
        prompts.sequence(SequenceRequest(token_ids=[5, 6, 8, 30], response_start=3))
    with pytest.raises(ValueError, match="empty prompt"):
        prompts.add([1], [])

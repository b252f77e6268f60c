"""The self-teacher's privileged prompt (issue #50 item 1): the template over a record's fields, how it sits in a
chat conversation, and the teacher's view of a scored sequence (same response ids, so the rows align)."""

import numpy as np
import pytest

from megatron_gkd.teacher.clients.privileged import (
    PrivilegedPrompts,
    privileged_conversation,
    render_privileged,
    template_fields,
)
from megatron_gkd.teacher.protocol.types import SequenceRequest

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


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from megatron_gkd.recipes.tiny import CHAT_TEMPLATE, build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size=64, chat_template=CHAT_TEMPLATE)


def _record(index, conversation, prompt_ids, response_ids=None, answer=None):
    from megatron_gkd.data import PromptRecord

    return PromptRecord(index=index, prompt_ids=tuple(prompt_ids), response_ids=response_ids, answer=answer,
                        conversation=conversation)


def test_learnt_prompts_go_through_the_students_chat_template(tokenizer):
    from megatron_gkd.recipes.tiny import CHAT_TEMPLATE
    from megatron_gkd.teacher.clients.privileged import learn_privileged

    def ids(text, specials=False):
        return tokenizer(text, add_special_tokens=specials)["input_ids"]

    chat = [{"role": "user", "content": "w5 w6"}]
    student = ids("<s> w5 w6 </s> <s>")
    response = (*ids("w9 w10"), tokenizer.eos_token_id)
    prompts = PrivilegedPrompts()
    learn_privileged(prompts, [_record(0, chat, student, response)], "w7 {response} w8 {prompt}", tokenizer,
                     CHAT_TEMPLATE)
    got = prompts.sequence(SequenceRequest(token_ids=[*student, *response], response_start=len(student)))
    # The reference is the user's text; the markup and the generation prompt are the template's, as the student's.
    np.testing.assert_array_equal(got.token_ids, [*ids("<s> w7 w9 w10 w8 w5 w6 </s> <s>"), *response])
    with pytest.raises(ValueError, match=r"prompt row 1: .*reads \{response\}.*it has answer, prompt"):
        learn_privileged(PrivilegedPrompts(), [_record(1, "w3", ids("w3", True), None, "w4")],
                         "{response} {prompt}", tokenizer, None)
    raw = PrivilegedPrompts()
    learn_privileged(raw, [_record(1, "w3", ids("w3", True), None, "w4")], "{answer} {prompt}", tokenizer, None)
    np.testing.assert_array_equal(raw.sequence(SequenceRequest(token_ids=[*ids("w3", True), 9],
                                                               response_start=1)).token_ids, [*ids("w4 w3", True), 9])
    with pytest.raises(ValueError, match="no conversation"):
        learn_privileged(PrivilegedPrompts(), [_record(2, None, [5])], "{prompt}", tokenizer, None)

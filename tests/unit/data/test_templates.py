"""``data.templates``: a chat template taken apart into the assistant's opening, its end of turn and the rest."""

import pytest

from megatron_gkd.data.templates import compare_renderings, render
from megatron_gkd.testing.hf_models import SMOLLM2_CHAT_TEMPLATE, save_chat_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(save_chat_tokenizer(tmp_path_factory.mktemp("tokenizer")))


def test_smollm2s_template_opens_and_ends_the_assistants_turn_as_chatml(tokenizer):
    rendering = render(tokenizer, SMOLLM2_CHAT_TEMPLATE)
    assert (rendering.opening, rendering.end) == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert rendering.prompts[0].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<|im_start|>system\nAnswer in one word.<|im_end|>" in rendering.prompts[1]  # a given system message wins


def test_only_the_part_that_differs_is_flagged(tokenizer):
    alike = compare_renderings(tokenizer, SMOLLM2_CHAT_TEMPLATE, tokenizer, SMOLLM2_CHAT_TEMPLATE)
    assert not alike.any
    other_system = SMOLLM2_CHAT_TEMPLATE.replace("named SmolLM", "named Teacher")
    system = compare_renderings(tokenizer, SMOLLM2_CHAT_TEMPLATE, tokenizer, other_system)
    assert (system.opening, system.end, system.prompts) == (False, False, True)
    assert system.first_prompts()[1].startswith("<|im_start|>system\nYou are a helpful AI assistant named Teacher")


def test_a_template_that_cannot_render_a_user_message_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="does not render a single user message"):
        render(tokenizer, "{{ raise_exception('no chat here') }}")

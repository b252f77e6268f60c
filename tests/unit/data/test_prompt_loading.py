"""load_prompts: both file formats, both prompt kinds, chat templates, length filters, reference responses."""

import copy
import logging

import pytest
from prompt_files import ASSISTANT, BOS, EOS, SYSTEM, TEMPLATE, USER, ids, write_jsonl, write_prompts

from megatron_gkd.data import DataConfig, PromptRecord, load_prompts, load_tokenizer

MIXED = [
    {"prompt": "w1 w2", "answer": "7"},
    {"messages": [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1 w2"}]},
    {"messages": [{"role": "user", "content": "w4"}, {"role": "assistant", "content": "w5 w6"}], "answer": "3"},
    {"prompt": "w3", "response": "w7"},
]
MIXED_WITH_TEMPLATE = [
    PromptRecord(index=0, prompt_ids=(BOS, USER, *ids("w1 w2"), ASSISTANT), response_ids=None, answer="7"),
    PromptRecord(index=1, prompt_ids=(BOS, SYSTEM, *ids("w9"), USER, *ids("w1 w2"), ASSISTANT), response_ids=None,
                 answer=None),
    PromptRecord(index=2, prompt_ids=(BOS, USER, *ids("w4"), ASSISTANT), response_ids=(*ids("w5 w6"), EOS),
                 answer="3"),
    PromptRecord(index=3, prompt_ids=(BOS, USER, *ids("w3"), ASSISTANT), response_ids=(*ids("w7"), EOS),
                 answer=None),
]


def _records(dataset):
    return [dataset[position] for position in range(len(dataset))]


@pytest.mark.parametrize("format", ["jsonl", "parquet"])
def test_text_and_chat_prompts_through_the_template(tmp_path, chat_tokenizer, format):
    path = write_prompts(tmp_path, "mixed", format, MIXED)
    dataset = load_prompts(path, DataConfig(), chat_tokenizer)
    assert _records(dataset) == MIXED_WITH_TEMPLATE
    assert dataset.stats.num_records == dataset.stats.num_kept == 4
    assert not dataset.has_responses  # two of the four carry one
    assert _records(load_prompts(path, DataConfig(), chat_tokenizer)) == MIXED_WITH_TEMPLATE


def test_kept_conversations_are_what_each_prompt_was_rendered_from(tmp_path, chat_tokenizer, plain_tokenizer):
    """keep_conversations (a teacher of another tokenizer renders them its own way): the messages the template read,
    a text prompt as one user message; raw text where no template is used; nothing unless asked."""
    path = write_prompts(tmp_path, "mixed", "jsonl", MIXED)
    kept = _records(load_prompts(path, DataConfig(), chat_tokenizer, keep_conversations=True))
    assert [r.conversation for r in kept] == [[{"role": "user", "content": "w1 w2"}], MIXED[1]["messages"],
                                              MIXED[2]["messages"][:1], [{"role": "user", "content": "w3"}]]
    assert [r.prompt_ids for r in kept] == [r.prompt_ids for r in MIXED_WITH_TEMPLATE]
    assert all(r.conversation is None for r in _records(load_prompts(path, DataConfig(), chat_tokenizer)))
    text = write_prompts(tmp_path, "text", "jsonl", [MIXED[0], MIXED[3]])
    raw = _records(load_prompts(text, DataConfig(), plain_tokenizer, keep_conversations=True))
    assert [r.conversation for r in raw] == ["w1 w2", "w3"]


def test_line_by_line_reader_gives_the_typed_readers_records(tmp_path, chat_tokenizer, caplog):
    """A bad line makes pyarrow give up on the file; the fallback must read the good lines identically."""
    bad = [*MIXED, "{not json", {"prompt": 5}]
    path = write_jsonl(tmp_path / "bad.jsonl", bad)
    with caplog.at_level(logging.INFO, logger="megatron_gkd.data"):
        dataset = load_prompts(path, DataConfig(max_bad_fraction=0.5), chat_tokenizer)
    assert "line by line" in caplog.text
    assert _records(dataset) == MIXED_WITH_TEMPLATE
    assert dataset.stats.malformed_reasons == {"undecodable JSON": 1, "prompt not a string": 1}


def test_blank_lines_are_not_records(tmp_path, chat_tokenizer):
    path = tmp_path / "blank.jsonl"
    for text in ('{"prompt": "w1"}\n\n   \n{"prompt": "w2"}\n', '{"prompt": "w1"}\n\n{"prompt": "w2"}\n{]\n'):
        path.write_text(text)  # the second file takes the line-by-line reader
        dataset = load_prompts(str(path), DataConfig(max_bad_fraction=0.5), chat_tokenizer)
        assert [record.index for record in _records(dataset)] == [0, 1]


def test_no_chat_template_gives_raw_text_with_the_tokenizers_special_tokens(tmp_path, chat_tokenizer,
                                                                            plain_tokenizer):
    path = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "w1 w2"}])
    expected = (BOS, *ids("w1 w2"))
    assert load_prompts(path, DataConfig(chat_template="none"), chat_tokenizer)[0].prompt_ids == expected
    assert load_prompts(path, DataConfig(chat_template="auto"), plain_tokenizer)[0].prompt_ids == expected


def test_template_file_overrides_the_tokenizers(tmp_path, chat_tokenizer, plain_tokenizer):
    template = tmp_path / "bare.jinja"
    template.write_text("{% for m in messages %}{{ m.content }} {% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    path = write_jsonl(tmp_path / "mixed.jsonl", MIXED[:2])
    for tokenizer in (chat_tokenizer, plain_tokenizer):
        dataset = load_prompts(path, DataConfig(chat_template=str(template)), tokenizer)
        assert [record.prompt_ids for record in _records(dataset)] == [(*ids("w1 w2"), ASSISTANT),
                                                                       (*ids("w9 w1 w2"), ASSISTANT)]


def test_tokenizer_with_named_templates_uses_its_default(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "w1"}])
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = {"tool_use": "{{ raise_exception('not this one') }}", "default": TEMPLATE}
    assert load_prompts(path, DataConfig(), tokenizer)[0].prompt_ids == (BOS, USER, *ids("w1"), ASSISTANT)
    tokenizer.chat_template = {"tool_use": TEMPLATE}
    with pytest.raises(ValueError, match="multiple chat templates.*data.chat_template"):
        load_prompts(path, DataConfig(), tokenizer)


def test_messages_without_a_template_name_the_fix(tmp_path, chat_tokenizer, plain_tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", MIXED[1:2])
    with pytest.raises(ValueError, match="no chat template.*data.chat_template"):
        load_prompts(path, DataConfig(), plain_tokenizer)
    with pytest.raises(ValueError, match="data.chat_template"):
        load_prompts(path, DataConfig(chat_template="none"), chat_tokenizer)


def test_broken_or_missing_template_file_fails_before_any_record(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "w1"}])
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="does not render"):
        load_prompts(path, DataConfig(chat_template=str(broken)), chat_tokenizer)
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(path, DataConfig(chat_template=str(tmp_path / "absent.jinja")), chat_tokenizer)


def test_template_errors_and_empty_renderings_are_malformed_records(tmp_path, chat_tokenizer):
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}"
                      "{% endif %}{{ m.content }} {% endfor %}<|assistant|>")
    path = write_jsonl(tmp_path / "chat.jsonl", MIXED[:2])
    dataset = load_prompts(path, DataConfig(chat_template=str(strict), max_bad_fraction=0.5), chat_tokenizer)
    assert [record.index for record in _records(dataset)] == [0]
    assert dataset.stats.malformed_reasons == {"chat template error": 1}
    assert "no system role" in dataset.stats.malformed_examples[0]

    silent = tmp_path / "silent.jinja"
    silent.write_text("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}")
    # The dropped record's response must not shift onto the next record.
    records = [{"messages": [{"role": "system", "content": "w2"}], "response": "w5"},
               {"prompt": "w1", "response": "w3"}]
    path = write_jsonl(tmp_path / "system_only.jsonl", records)
    dataset = load_prompts(path, DataConfig(chat_template=str(silent), max_bad_fraction=0.5), chat_tokenizer)
    assert dataset.stats.malformed_reasons == {"prompt has no tokens": 1}
    assert _records(dataset) == [PromptRecord(index=1, prompt_ids=tuple(ids("w1")), response_ids=(*ids("w3"), EOS),
                                              answer=None)]


def test_length_filters_drop_and_count(tmp_path, chat_tokenizer, caplog):
    records = [
        {"prompt": "w1", "response": "w1 w2"},         # prompt 4 tokens, response 3 with EOS: kept
        {"prompt": "w1 w2", "response": "w1"},         # prompt 5 tokens: too long
        {"prompt": "w1", "response": "w1 w2 w3"},      # response 4 tokens: too long
        {"prompt": "w1 w2 w3", "response": "w1 w2 w3"},  # both too long: counted once, as a long prompt
        {"prompt": "w2"},                              # no response: only the prompt limit applies
    ]
    path = write_jsonl(tmp_path / "lengths.jsonl", records)
    with caplog.at_level(logging.INFO, logger="megatron_gkd.data"):
        dataset = load_prompts(path, DataConfig(max_prompt_length=4, max_response_length=3), chat_tokenizer)
    assert [record.index for record in _records(dataset)] == [0, 4]
    stats = dataset.stats
    assert (stats.num_records, stats.num_prompt_too_long, stats.num_response_too_long, stats.num_kept) == (5, 2, 1, 2)
    assert stats.summary() in caplog.text
    assert "2 prompts too long, 1 responses too long, 2 kept" in stats.summary()


def test_response_limit_without_responses_warns(tmp_path, chat_tokenizer, caplog):
    path = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "w1"}])
    with caplog.at_level(logging.WARNING, logger="megatron_gkd.data"):
        load_prompts(path, DataConfig(max_response_length=8), chat_tokenizer, show_progress=True)
    assert "data.max_response_length=8 has no effect" in caplog.text


def test_nothing_left_after_filtering_names_the_limit(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "w1 w2 w3"}])
    with pytest.raises(ValueError, match="no prompt is left.*raise data.max_prompt_length=4$"):
        load_prompts(path, DataConfig(max_prompt_length=4), chat_tokenizer)
    path = write_jsonl(tmp_path / "long_response.jsonl", [{"prompt": "w1", "response": "w1 w2 w3"}])
    with pytest.raises(ValueError, match="no prompt is left.*raise data.max_response_length=2$"):
        load_prompts(path, DataConfig(max_response_length=2), chat_tokenizer)


def test_reference_responses_end_with_eos_and_can_be_required(tmp_path, chat_tokenizer):
    records = [
        {"prompt": "w1", "response": "w2 w3"},
        {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w4"}]},
        # An explicit response wins; the conversation, assistant turn included, is then the prompt.
        {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w4"}],
         "response": "w5"},
    ]
    path = write_jsonl(tmp_path / "responses.jsonl", records)
    dataset = load_prompts(path, DataConfig(), chat_tokenizer, require_responses=True)
    assert dataset.has_responses
    assert [record.response_ids for record in _records(dataset)] == [(*ids("w2 w3"), EOS), (*ids("w4"), EOS),
                                                                     (*ids("w5"), EOS)]
    assert dataset[2].prompt_ids == (BOS, USER, *ids("w1"), ASSISTANT, *ids("w4"), ASSISTANT)

    path = write_jsonl(tmp_path / "prompts_only.jsonl", [{"prompt": "w1"}, {"prompt": "w2", "response": "w3"}])
    assert len(load_prompts(path, DataConfig(), chat_tokenizer)) == 2
    with pytest.raises(ValueError, match=r"1 of 2 records.*'no response': 1.*off_policy and sft modes"):
        load_prompts(path, DataConfig(), chat_tokenizer, require_responses=True)


@pytest.mark.parametrize("format", ["jsonl", "parquet"])
def test_answers_are_strings_or_integers(tmp_path, chat_tokenizer, format):
    path = write_prompts(tmp_path, "int", format, [{"prompt": "w1", "answer": 42}, {"prompt": "w2", "answer": -1}])
    assert [record.answer for record in _records(load_prompts(path, DataConfig(), chat_tokenizer))] == ["42", "-1"]
    path = write_prompts(tmp_path, "float", format, [{"prompt": "w1", "answer": 4.0}, {"prompt": "w2"}])
    dataset = load_prompts(path, DataConfig(max_bad_fraction=0.5), chat_tokenizer)
    assert dataset.stats.malformed_reasons == {"answer not a string": 1}


def test_limit_keeps_the_first_records_that_survive_filtering(tmp_path, chat_tokenizer):
    records = [{"prompt": "w1"}, {"prompt": "w1 w2 w3"}, {"prompt": "w2"}, {"prompt": "w3"}]
    path = write_jsonl(tmp_path / "eval.jsonl", records)
    dataset = load_prompts(path, DataConfig(max_prompt_length=4), chat_tokenizer, limit=2)
    assert [record.index for record in _records(dataset)] == [0, 2]
    assert (dataset.stats.num_records, dataset.stats.num_prompt_too_long) == (3, 1)


def test_positions_index_like_a_sequence(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "w1"}, {"prompt": "w2"}])
    dataset = load_prompts(path, DataConfig(), chat_tokenizer)
    assert dataset[-1] == dataset[1]
    with pytest.raises(IndexError):
        dataset[2]


def test_format_by_extension_or_by_config(tmp_path, chat_tokenizer):
    json_lines = tmp_path / "prompts.json"
    json_lines.write_text('{"prompt": "w1"}\n{"prompt": "w2"}\n')
    assert len(load_prompts(str(json_lines), DataConfig(), chat_tokenizer)) == 2
    text = tmp_path / "prompts.txt"
    text.write_text('{"prompt": "w1"}\n')
    with pytest.raises(ValueError, match="data.format"):
        load_prompts(str(text), DataConfig(), chat_tokenizer)
    assert len(load_prompts(str(text), DataConfig(format="jsonl"), chat_tokenizer)) == 1
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        load_prompts(str(text), DataConfig(format="parquet"), chat_tokenizer)


def test_missing_or_empty_file(tmp_path, chat_tokenizer):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(str(tmp_path / "absent.jsonl"), DataConfig(), chat_tokenizer)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no records"):
        load_prompts(str(empty), DataConfig(), chat_tokenizer)


def test_load_tokenizer_names_what_to_point_at(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))

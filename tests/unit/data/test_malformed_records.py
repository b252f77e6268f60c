"""Malformed records are skipped and counted by reason; past data.max_bad_fraction loading fails."""

import logging

import pytest
from prompt_files import write_jsonl, write_prompts

from megatron_gkd.data import DataConfig, load_prompts

GOOD = [{"prompt": f"w{i}"} for i in range(20)]
USER = {"role": "user", "content": "w1"}
# (line, reason): every kind of bad record a JSON-lines file can hold.
BAD_LINES = [
    ('{"prompt": "w1"', "undecodable JSON"),
    ('["w1"]', "not a JSON object"),
    ({"text": "w1"}, "no prompt"),
    ({"prompt": None}, "no prompt"),
    ({"prompt": ["w1"]}, "prompt not a string"),
    ({"prompt": "  "}, "empty prompt"),
    ({"prompt": "w1", "messages": [USER]}, "prompt and messages both set"),
    ({"messages": "w1"}, "messages not a list"),
    ({"messages": []}, "empty messages"),
    ({"messages": [{"role": "assistant", "content": "w1"}]}, "empty messages"),
    ({"messages": [USER, "w2"]}, "bad message"),
    ({"messages": [{"role": "user"}]}, "bad message"),
    ({"messages": [{"role": "user", "content": 3}]}, "bad message"),
    ({"messages": [{"role": "robot", "content": "w1"}]}, "bad role"),
    ({"messages": [{"content": "w1"}]}, "bad role"),
    ({"prompt": "w1", "response": 5}, "response not a string"),
    ({"prompt": "w1", "response": ""}, "empty response"),
    ({"prompt": "w1", "answer": 1.5}, "answer not a string"),
    ({"prompt": "w1", "answer": True}, "answer not a string"),
]


def _expected_reasons(lines):
    reasons = {}
    for _, reason in lines:
        reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


def test_every_kind_is_counted_by_reason_and_skipped(tmp_path, chat_tokenizer, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", GOOD + [line for line, _ in BAD_LINES])
    with open(path, "ab") as file:
        file.write(b'{"prompt": "\xff"}\n')  # not UTF-8
    with caplog.at_level(logging.INFO, logger="megatron_gkd.data"):
        dataset = load_prompts(path, DataConfig(max_bad_fraction=0.5), chat_tokenizer)
    stats = dataset.stats
    expected = _expected_reasons(BAD_LINES)
    expected["undecodable JSON"] += 1
    assert stats.malformed_reasons == expected
    assert stats.num_malformed == len(BAD_LINES) + 1
    assert stats.num_records == len(GOOD) + len(BAD_LINES) + 1
    assert stats.num_kept == len(GOOD)
    assert [dataset[position].index for position in range(len(GOOD))] == list(range(len(GOOD)))
    assert stats.malformed_examples[0].startswith(f"row {len(GOOD)}: undecodable JSON")
    assert any(record.levelno == logging.WARNING and "20 malformed (" in record.getMessage()
               for record in caplog.records)


@pytest.mark.parametrize("format", ["jsonl", "parquet"])
def test_under_the_fraction_loads_past_it_fails_with_counts_reasons_and_examples(tmp_path, chat_tokenizer,
                                                                                 format):
    bad = [{"prompt": None}, {"prompt": "w1", "response": ""}]
    path = write_prompts(tmp_path, "two_bad", format, GOOD[:18] + bad)  # 2 of 20 = 10%
    dataset = load_prompts(path, DataConfig(max_bad_fraction=0.1), chat_tokenizer)
    assert (dataset.stats.num_malformed, dataset.stats.num_kept) == (2, 18)
    with pytest.raises(ValueError) as raised:
        load_prompts(path, DataConfig(max_bad_fraction=0.09), chat_tokenizer)
    message = str(raised.value)
    for part in ("2 of 20 records are malformed", "10.0% > data.max_bad_fraction=0.09", "'no prompt': 1",
                 "'empty response': 1", "row 18: no prompt", "row 19: empty response", "data.max_bad_fraction"):
        assert part in message


def test_parquet_without_any_prompt_column(tmp_path, chat_tokenizer):
    path = write_prompts(tmp_path, "other", "parquet", [{"text": "w1"}, {"text": "w2"}])
    with pytest.raises(ValueError, match=r"'no prompt': 2.*data.prompt_key"):
        load_prompts(path, DataConfig(), chat_tokenizer)
    assert len(load_prompts(path, DataConfig(prompt_key="text"), chat_tokenizer)) == 2


@pytest.mark.parametrize("format", ["jsonl", "parquet"])
def test_records_with_both_prompt_kinds_need_one_key_switched_off(tmp_path, chat_tokenizer, format):
    path = write_prompts(tmp_path, "both", format, [{"prompt": "w1", "messages": [USER]}])
    with pytest.raises(ValueError, match="data.prompt_key=null"):
        load_prompts(path, DataConfig(), chat_tokenizer)
    assert len(load_prompts(path, DataConfig(prompt_key=None), chat_tokenizer)) == 1
    assert len(load_prompts(path, DataConfig(messages_key=None), chat_tokenizer)) == 1


def test_parquet_messages_with_extra_fields_keep_role_and_content(tmp_path, chat_tokenizer):
    messages = [{"role": "user", "content": "w1", "name": "x"}, {"role": "assistant", "content": "w2", "name": "y"}]
    parquet = write_prompts(tmp_path, "chat", "parquet", [{"messages": messages}])
    jsonl = write_prompts(tmp_path, "chat", "jsonl", [{"messages": messages}])
    assert load_prompts(parquet, DataConfig(), chat_tokenizer)[0] == load_prompts(jsonl, DataConfig(),
                                                                                   chat_tokenizer)[0]

"""DataConfig: OmegaConf structured-config round trip and messages that name the key and the fix."""

import dataclasses

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from megatron_gkd.data import DataConfig


def _from_dotlist(*overrides: str) -> DataConfig:
    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_object(merged)


def test_round_trip_through_omegaconf():
    overrides = {"train_path": "train.parquet", "eval_path": "eval.jsonl", "format": "auto", "prompt_key": "question",
                 "messages_key": None, "response_key": "teacher_response", "answer_key": "label",
                 "chat_template": "templates/chat.jinja", "max_prompt_length": 512, "max_response_length": 256,
                 "shuffle": False, "seed": 7, "max_bad_fraction": 0.2, "num_eval_prompts": 64, "group_key": "task"}
    loaded = _from_dotlist(*(f"{key}={'null' if value is None else value}" for key, value in overrides.items()))
    assert loaded == DataConfig(**overrides)
    assert isinstance(loaded, DataConfig)
    assert _from_dotlist() == DataConfig()
    assert _from_dotlist("max_response_length=null").max_response_length is None
    assert _from_dotlist("messages_key=").messages_key is None  # what `data.messages_key=''` is after the shell
    # Every field is a plain type the structured config can hold and merge back.
    assert OmegaConf.to_object(OmegaConf.structured(loaded)) == loaded
    assert {field.name for field in dataclasses.fields(DataConfig)} == set(overrides)


def test_unknown_key_fails_naming_the_closest():
    with pytest.raises(ConfigKeyError, match="Did you mean.*'max_prompt_length'"):
        _from_dotlist("max_prompt_lenght=10")


def test_validation_goes_through_omegaconf():
    with pytest.raises(ValueError, match="data.max_prompt_length"):
        _from_dotlist("max_prompt_length=0")


@pytest.mark.parametrize("overrides, match", [
    ({"format": "csv"}, r"data.format='csv'; choose one of"),
    ({"train_path": "prompts.csv"}, r"data.train_path='prompts.csv'.*set data.format"),
    ({"eval_path": "eval"}, r"data.eval_path='eval'"),
    ({"prompt_key": None, "messages_key": None}, "set at least one of them"),
    ({"prompt_key": "", "messages_key": None}, "set at least one of them"),
    ({"response_key": ""}, "data.response_key is empty"),
    ({"answer_key": ""}, "data.answer_key is empty"),
    ({"prompt_key": "text", "answer_key": "text"}, "two fields share one name"),
    ({"chat_template": "chatml"}, r"data.chat_template='chatml'; choose 'auto', 'none' or the path of a .jinja"),
    ({"max_prompt_length": 0}, "data.max_prompt_length must be >= 1"),
    ({"max_response_length": 0}, "data.max_response_length must be >= 1 or null"),
    ({"seed": -1}, "data.seed must be >= 0"),
    ({"max_bad_fraction": 1.5}, r"data.max_bad_fraction must lie in \[0, 1\]"),
    ({"num_eval_prompts": 0}, "data.num_eval_prompts must be >= 1 or null"),
])
def test_bad_values_name_the_key_and_the_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**overrides)


def test_explicit_format_accepts_any_extension():
    assert DataConfig(train_path="prompts.txt", format="jsonl").train_path == "prompts.txt"

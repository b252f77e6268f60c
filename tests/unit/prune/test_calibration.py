"""Calibration tokens: records through the chat template, prompt then response, packed into sequences."""

import logging

import pytest
import torch

from megatron_gkd.prune import calibration_tokens, pack
from megatron_gkd.prune.builtin_text import BUILTIN_RECORDS
from tests.unit.data.prompt_files import ASSISTANT, BOS, EOS, TEMPLATE, USER, ids, save_tokenizer, write_jsonl


def test_pack_concatenates_documents_and_cuts_rows():
    assert pack([[1, 2, 3], [4, 5], [6, 7, 8]], num_samples=2, seq_length=3).tolist() == [[1, 2, 3], [4, 5, 6]]


def test_pack_gives_fewer_rows_with_a_warning_and_fails_below_one(caplog):
    with caplog.at_level(logging.WARNING):
        assert pack([[1, 2, 3, 4, 5]], num_samples=3, seq_length=2).tolist() == [[1, 2], [3, 4]]
    assert "fills 2 of the 3 sequences" in caplog.text
    with pytest.raises(ValueError, match="holds 5 tokens, fewer than one sequence of seq_length=6"):
        pack([[1, 2, 3, 4, 5]], num_samples=1, seq_length=6)


def test_a_prompt_file_goes_through_the_chat_template_prompt_then_response(tmp_path):
    tokenizer = save_tokenizer(tmp_path / "tokenizer", TEMPLATE)
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "w1 w2", "response": "w3"},
                                                     {"messages": [{"role": "user", "content": "w4"}]},
                                                     {"prompt": "w5 w6 w7", "response": "w8 w9"}])
    tokens = calibration_tokens(tokenizer, path=path, num_samples=3, seq_length=6)
    first = [BOS, USER, *ids("w1 w2"), ASSISTANT, *ids("w3"), EOS]
    second = [BOS, USER, *ids("w4"), ASSISTANT]
    third = [BOS, USER, *ids("w5 w6 w7"), ASSISTANT, *ids("w8 w9"), EOS]
    assert tokens.dtype == torch.int64
    assert tokens.flatten().tolist() == (first + second + third)[:18]


def test_raw_text_without_a_template(tmp_path):
    tokenizer = save_tokenizer(tmp_path / "tokenizer", None)
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "w1 w2 w3", "response": "w4"}] * 4)
    tokens = calibration_tokens(tokenizer, path=path, num_samples=2, seq_length=4)
    assert tokens.tolist() == [[BOS, *ids("w1 w2 w3")], [*ids("w4"), EOS, BOS, *ids("w1")]]


def test_the_built_in_set_comes_through_the_tokenizer(tmp_path):
    # A word-level stand-in for a real tokenizer: every word of the built-in text is one token.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({word for record in BUILTIN_RECORDS for text in record.values() for word in text.split()})
    vocab = {word: i for i, word in enumerate(["<unk>", "<s>", "</s>", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
                            ).save_pretrained(tmp_path)
    tokens = calibration_tokens(str(tmp_path), num_samples=8, seq_length=256)
    assert tokens.shape == (8, 256) and (tokens != 0).all()  # no unknown words: the built-in text came through

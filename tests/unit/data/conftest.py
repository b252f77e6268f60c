"""Tokenizers for the data tests, loaded the way the trainer loads them."""

import pytest
from prompt_files import TEMPLATE, save_tokenizer

from megatron_gkd.data import load_tokenizer


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """A tokenizer directory with a chat template, loaded the way the trainer loads it."""
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"), TEMPLATE))


@pytest.fixture(scope="session")
def plain_tokenizer(tmp_path_factory):
    """The same vocabulary without a chat template."""
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("plain_tokenizer"), None))

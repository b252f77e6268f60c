"""Calibration tokens: prompts and their reference responses through the chat template, packed into sequences.

A calibration file is a prompt dataset like the trainer's (JSONL or Parquet, ``prompt`` or ``messages``, an optional
``response``), read by :func:`megatron_gkd.data.load_prompts` with the teacher's tokenizer and chat template; the
built-in set (:mod:`megatron_gkd.prune.builtin_text`) goes through the same reader. Each record becomes its prompt
ids followed by its response ids (when it has one): the text the student will see. The records are concatenated in
file order and cut into ``num_samples`` sequences of ``seq_length`` tokens: packing wastes no position on padding,
and activation statistics do not care where a document starts.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
from typing import Iterable, Sequence

import torch

from megatron_gkd.data import DataConfig, load_prompts, load_tokenizer
from megatron_gkd.prune.builtin_text import BUILTIN_RECORDS

logger = logging.getLogger(__name__)

# A large prompt file is not tokenized whole: the first read takes records enough for the tokens asked for at this
# many tokens a record, and each further read four times as many, until the tokens suffice or the file ends.
_TOKENS_PER_RECORD = 64


def calibration_tokens(tokenizer_path: str, *, path: str | None = None, num_samples: int = 16, seq_length: int = 256,
                       chat_template: str = "auto", show_progress: bool = False) -> torch.Tensor:
    """``[num_samples, seq_length]`` int64 token ids of the calibration text.

    Args:
        tokenizer_path: the directory of the tokenizer (the teacher's checkpoint).
        path: a prompt file; ``None`` for the built-in set.
        num_samples, seq_length: the shape of the result.
        chat_template: ``auto`` (the tokenizer's), ``none`` (raw text) or a ``.jinja`` file (``data.chat_template``).
        show_progress: a progress bar while tokenizing (rank 0).

    Raises:
        ValueError: bad sizes, an unreadable file, or text shorter than one sequence (the message says how many
            tokens it holds).
    """
    if num_samples < 1 or seq_length < 2:
        raise ValueError(f"calibration needs num_samples >= 1 and seq_length >= 2, got {num_samples} and {seq_length}")
    tokenizer = load_tokenizer(tokenizer_path)
    # Prompts are cut by packing, never dropped for their length.
    config = DataConfig(chat_template=chat_template, max_prompt_length=2**31 - 1)
    if path is not None:
        documents = _file_documents(path, config, tokenizer, num_samples * seq_length, show_progress)
    else:
        with tempfile.TemporaryDirectory(prefix="calibration-") as folder:
            builtin = os.path.join(folder, "builtin.jsonl")
            with open(builtin, "w") as handle:
                handle.writelines(json.dumps(record) + "\n" for record in BUILTIN_RECORDS)
            documents = _documents(load_prompts(builtin, config, tokenizer))
    tokens = pack(documents, num_samples, seq_length)
    logger.info("calibration: %d sequences of %d tokens from %s", tokens.shape[0], seq_length, path or "the built-in set")
    return tokens


def _documents(dataset) -> list[tuple[int, ...]]:
    """Each record's prompt ids followed by its response ids."""
    return [(*record.prompt_ids, *(record.response_ids or ())) for record in dataset]


def _file_documents(path: str, config: DataConfig, tokenizer, wanted: int, show_progress: bool) -> list[tuple[int, ...]]:
    limit = wanted // _TOKENS_PER_RECORD + 1
    while True:
        dataset = load_prompts(path, config, tokenizer, limit=limit, show_progress=show_progress)
        documents = _documents(dataset)
        if sum(map(len, documents)) >= wanted or len(dataset) < limit:  # enough, or the file's end
            return documents
        limit *= 4


def pack(documents: Iterable[Sequence[int]], num_samples: int, seq_length: int) -> torch.Tensor:
    """The first ``num_samples x seq_length`` tokens of the concatenated documents as ``[n, seq_length]``.

    Fewer rows (with a warning) when the documents hold fewer tokens.

    Raises:
        ValueError: the documents hold fewer than ``seq_length`` tokens.
    """
    wanted = num_samples * seq_length
    stream = list(itertools.islice(itertools.chain.from_iterable(documents), wanted))
    rows = len(stream) // seq_length
    if rows == 0:
        raise ValueError(f"the calibration text holds {len(stream)} tokens, fewer than one sequence of seq_length="
                         f"{seq_length}; give a larger --calibration file or a smaller --seq-length")
    if rows < num_samples:
        logger.warning("the calibration text fills %d of the %d sequences asked for (%d tokens); give a larger "
                       "--calibration file for more", rows, num_samples, len(stream))
    return torch.tensor(stream[: rows * seq_length], dtype=torch.int64).view(rows, seq_length)

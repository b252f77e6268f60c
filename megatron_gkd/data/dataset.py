"""Prompt datasets: a file's records checked, put through the chat template, tokenized and filtered."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import operator
from typing import NamedTuple

import numpy as np
import tqdm

from megatron_gkd.data.config import DataConfig, resolve_format
from megatron_gkd.data.readers import Fields, Malformed, Row, open_rows
from megatron_gkd.data.records import HINTS, ParsedRecord, parse_record
from megatron_gkd.data.tokenization import eos_token_id, prompt_conversation, render_prompt, resolve_chat_template, tokenize_texts

logger = logging.getLogger(__name__)

_CHUNK_ROWS = 1024
_NUM_EXAMPLES = 5


@dataclasses.dataclass(frozen=True, slots=True)
class PromptRecord:
    """One prompt of a dataset, ready for rollout."""

    index: int
    """Row of the record in its file (blank JSON lines do not count): the stable id of the prompt."""
    prompt_ids: tuple[int, ...]
    """Token ids after the chat template."""
    response_ids: tuple[int, ...] | None
    """Reference response ids ending with the EOS id, or ``None`` when the record has none."""
    answer: str | None
    """Reference answer for eval scorers, or ``None``."""
    group: str | None = None
    """The record's ``data.group_key`` field (e.g. its task: eval reports accuracy per group, and
    ``teacher_mix.mode=route`` sends it to the teacher of that name), or ``None``."""
    conversation: str | list[dict[str, str]] | None = None
    """What ``prompt_ids`` were rendered from (:func:`~megatron_gkd.data.tokenization.prompt_conversation`: the raw
    text, or the messages the chat template read), kept when the dataset is loaded with ``keep_conversations``
    (a teacher of another tokenizer renders it with its own template); else ``None``."""


@dataclasses.dataclass
class DatasetStats:
    """What loading kept and dropped, and why."""

    num_records: int = 0
    """Records read (all of the file unless a limit stopped reading early)."""
    num_malformed: int = 0
    malformed_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    num_prompt_too_long: int = 0
    num_response_too_long: int = 0
    num_kept: int = 0
    malformed_examples: list[str] = dataclasses.field(default_factory=list)
    """The first few malformed records, ``"row N: reason (detail)"``."""

    def add_malformed(self, index: int, malformed: Malformed) -> None:
        self.num_malformed += 1
        self.malformed_reasons[malformed.reason] = self.malformed_reasons.get(malformed.reason, 0) + 1
        if len(self.malformed_examples) < _NUM_EXAMPLES:
            self.malformed_examples.append(malformed.describe(index))

    def summary(self) -> str:
        """One log line: records, malformed by reason, too long, kept."""
        reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(self.malformed_reasons.items()))
        malformed = f"{self.num_malformed} malformed" + (f" ({reasons})" if reasons else "")
        return (f"{self.num_records} records, {malformed}, {self.num_prompt_too_long} prompts too long, "
                f"{self.num_response_too_long} responses too long, {self.num_kept} kept")


class PromptDataset:
    """Tokenized prompts that survived filtering; ``dataset[position]`` builds a :class:`PromptRecord`."""

    def __init__(self, path: str, stats: DatasetStats, indices: np.ndarray, prompts: TokenColumn,
                 responses: TokenColumn, has_response: np.ndarray, answers: list[str | None],
                 groups: list[str | None] | None = None, conversations: list[str | None] | None = None):
        assert len(indices) == len(prompts) == len(responses) == len(has_response) == len(answers)
        self._groups = groups if groups is not None else [None] * len(indices)
        self._conversations = conversations  # JSON text: a str per record costs its length, a list of dicts far more
        self.path = path
        self.stats = stats
        self._indices = indices
        self._prompts = prompts
        self._responses = responses
        self._has_response = has_response
        self._answers = answers

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, position: int) -> PromptRecord:
        position = operator.index(position)
        if not -len(self) <= position < len(self):
            raise IndexError(f"position {position} out of range for {len(self)} prompts of {self.path}")
        position %= len(self)
        response = self._responses[position] if self._has_response[position] else None
        conversation = self._conversations[position] if self._conversations is not None else None
        return PromptRecord(index=int(self._indices[position]), prompt_ids=self._prompts[position],
                            response_ids=response, answer=self._answers[position], group=self._groups[position],
                            conversation=None if conversation is None else json.loads(conversation))

    @property
    def has_responses(self) -> bool:
        """Whether every prompt carries a reference response (always true with ``require_responses``)."""
        return len(self) > 0 and bool(self._has_response.all())


def load_prompts(path: str, config: DataConfig, tokenizer, *, require_responses: bool = False,
                 limit: int | None = None, show_progress: bool = False,
                 keep_conversations: bool = False) -> PromptDataset:
    """Reads, checks, templates, tokenizes and filters the prompts of ``path``.

    The result depends only on the file, ``config`` and the tokenizer, so every rank that loads the same
    file holds the same dataset.

    Args:
        require_responses: records without a reference response are malformed (off_policy / sft modes).
        limit: keep at most the first ``limit`` records that survive filtering, and stop reading there.
        show_progress: draw a progress bar (pass it on rank 0 only; it stays off when stderr is not a TTY).
        keep_conversations: keep each record's conversation (``PromptRecord.conversation``) beside its ids.

    Raises:
        ValueError: more than ``config.max_bad_fraction`` of the records read is malformed (the message holds
            the counts by reason and examples), nothing is left after filtering, chat messages meet a
            tokenizer without a chat template, or the file cannot be read.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    fields = Fields(prompt=config.prompt_key, messages=config.messages_key, response=config.response_key,
                    answer=config.answer_key, group=config.group_key)
    template = resolve_chat_template(config, tokenizer)
    eos = eos_token_id(tokenizer)
    num_rows, chunks = open_rows(path, resolve_format(path, config.format), fields, _CHUNK_ROWS)
    stats = DatasetStats()
    kept = _Kept(keep_conversations)
    bar = tqdm.tqdm(total=num_rows, desc=f"tokenizing {path}", unit="rows", disable=None if show_progress else True)
    with bar:
        for chunk in chunks:
            outcomes = _tokenize_chunk(chunk, fields, template, tokenizer, eos, require_responses, keep_conversations)
            for index, outcome in outcomes:
                stats.num_records += 1
                _tally(stats, kept, index, outcome, config)
                if limit is not None and stats.num_kept == limit:
                    break
            kept.flush()
            bar.update(stats.num_records - bar.n)
            if limit is not None and stats.num_kept == limit:
                break
    _report(path, stats, config, template)
    if config.max_response_length is not None and not any(kept.has_response):
        logger.warning("data.max_response_length=%d has no effect on %s: its records carry no reference responses",
                       config.max_response_length, path)
    return kept.build(path, stats)


class _Tokenized(NamedTuple):
    prompt_ids: list[int]
    response_ids: list[int] | None
    answer: str | None
    group: str | None
    conversation: str | None  # JSON, with keep_conversations


def _tokenize_chunk(chunk: list[Row], fields: Fields, template: str | None, tokenizer, eos: int,
                    require_responses: bool, keep_conversations: bool) -> list[tuple[int, Malformed | _Tokenized]]:
    """What became of every row of ``chunk``, in file order."""
    outcomes: dict[int, Malformed | _Tokenized] = {}
    parsed: list[ParsedRecord] = []
    texts: list[str] = []
    for index, row in chunk:
        record = row if isinstance(row, Malformed) else parse_record(index, row, fields,
                                                                     require_responses=require_responses)
        text = record if isinstance(record, Malformed) else render_prompt(record, template, tokenizer)
        if isinstance(text, Malformed):
            outcomes[index] = text
        else:
            parsed.append(record)
            texts.append(text)
    # A template writes its own special tokens (a BOS among them); adding them again would double the BOS.
    prompt_ids = tokenize_texts(tokenizer, texts, add_special_tokens=template is None)
    with_response = [record for record in parsed if record.response is not None]
    response_ids = iter(tokenize_texts(tokenizer, [record.response for record in with_response],
                                       add_special_tokens=False))
    for record, ids in zip(parsed, prompt_ids, strict=True):
        # Take the response first: the responses line up with the records that have one, kept or not.
        response = None if record.response is None else [*next(response_ids), eos]
        conversation = json.dumps(prompt_conversation(record, template)) if keep_conversations else None
        outcomes[record.index] = _Tokenized(ids, response, record.answer, record.group, conversation) if ids \
            else Malformed("prompt has no tokens")
    return [(index, outcomes[index]) for index, _ in chunk]


def _tally(stats: DatasetStats, kept: _Kept, index: int, outcome: Malformed | _Tokenized,
           config: DataConfig) -> None:
    if isinstance(outcome, Malformed):
        stats.add_malformed(index, outcome)
        return
    prompt_ids, response_ids, answer, group, conversation = outcome
    if len(prompt_ids) > config.max_prompt_length:
        stats.num_prompt_too_long += 1
    elif (response_ids is not None and config.max_response_length is not None
          and len(response_ids) > config.max_response_length):
        stats.num_response_too_long += 1
    else:
        stats.num_kept += 1
        kept.add(index, prompt_ids, response_ids, answer, group, conversation)


def _report(path: str, stats: DatasetStats, config: DataConfig, template: str | None) -> None:
    """Logs the summary line; raises past the bad fraction or when nothing is left."""
    text = "chat template" if template is not None else "raw text"
    summary = f"prompts {path} ({text}): {stats.summary()}"
    if stats.num_records == 0:
        raise ValueError(f"prompt file {path!r} holds no records; check data.train_path / data.eval_path")
    fraction = stats.num_malformed / stats.num_records
    if fraction > config.max_bad_fraction:
        top = max(stats.malformed_reasons, key=stats.malformed_reasons.get)
        hint = HINTS.get(top, "fix these records")
        raise ValueError(f"{path}: {stats.num_malformed} of {stats.num_records} records are malformed "
                         f"({fraction:.1%} > data.max_bad_fraction={config.max_bad_fraction}); by reason: "
                         f"{stats.malformed_reasons}; e.g. {'; '.join(stats.malformed_examples)}. {hint}, or raise "
                         "data.max_bad_fraction to skip them")
    (logger.warning if stats.num_malformed else logger.info)("%s", summary)
    if stats.num_kept == 0:
        fixes = [f"raise data.max_prompt_length={config.max_prompt_length}"] if stats.num_prompt_too_long else []
        if stats.num_response_too_long:
            fixes.append(f"raise data.max_response_length={config.max_response_length}")
        raise ValueError(f"{path}: no prompt is left after filtering ({stats.summary()}); "
                         + (" or ".join(fixes) or "fix the malformed records"))


class TokenColumn:
    """Token id sequences in one flat int32 array with offsets: 4 bytes a token, where lists of Python ints
    cost 8-36. Sequences are appended chunk by chunk, then :meth:`finish` freezes the column."""

    def __init__(self):
        self._parts: list[np.ndarray] = []
        self._pending: list[list[int]] = []
        self._lengths: list[int] = []
        self._tokens: np.ndarray | None = None
        self._offsets: np.ndarray | None = None

    def append(self, ids: list[int]) -> None:
        self._pending.append(ids)
        self._lengths.append(len(ids))

    def flush(self) -> None:
        """Packs the sequences appended since the last flush (bounds the Python lists alive at a time)."""
        if self._pending:
            self._parts.append(np.fromiter(itertools.chain.from_iterable(self._pending), dtype=np.int32))
            self._pending = []

    def finish(self) -> TokenColumn:
        self.flush()
        self._tokens = np.concatenate(self._parts) if self._parts else np.zeros(0, dtype=np.int32)
        self._offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=self._offsets[1:])
        self._parts, self._lengths = [], []
        return self

    def __len__(self) -> int:
        assert self._offsets is not None, "finish() the column first"
        return len(self._offsets) - 1

    def __getitem__(self, position: int) -> tuple[int, ...]:
        assert self._offsets is not None, "finish() the column first"
        return tuple(self._tokens[self._offsets[position]:self._offsets[position + 1]].tolist())


class _Kept:
    """The records that survive filtering, gathered chunk by chunk."""

    def __init__(self, keep_conversations: bool = False):
        self.indices: list[int] = []
        self.conversations: list[str | None] | None = [] if keep_conversations else None
        self.prompts = TokenColumn()
        self.responses = TokenColumn()
        self.has_response: list[bool] = []
        self.answers: list[str | None] = []
        self.groups: list[str | None] = []

    def add(self, index: int, prompt_ids: list[int], response_ids: list[int] | None, answer: str | None,
            group: str | None = None, conversation: str | None = None) -> None:
        self.indices.append(index)
        if self.conversations is not None:
            self.conversations.append(conversation)
        self.prompts.append(prompt_ids)
        self.responses.append(response_ids or [])
        self.has_response.append(response_ids is not None)
        self.answers.append(answer)
        self.groups.append(group)

    def flush(self) -> None:
        self.prompts.flush()
        self.responses.flush()

    def build(self, path: str, stats: DatasetStats) -> PromptDataset:
        return PromptDataset(path, stats, np.asarray(self.indices, dtype=np.int64), self.prompts.finish(),
                             self.responses.finish(), np.asarray(self.has_response, dtype=bool), self.answers,
                             self.groups, self.conversations)

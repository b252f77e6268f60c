"""The ``data`` section of the trainer's config: where prompts come from and how they are filtered."""

from __future__ import annotations

import dataclasses
import pathlib

FORMATS = ("auto", "jsonl", "parquet")
# Extensions that `format=auto` recognises; `.json` files are read as JSON lines, one object a line.
EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
CHAT_TEMPLATE_MODES = ("auto", "none")


@dataclasses.dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompt datasets for training and eval (``megatron_gkd.data.load_prompts`` reads them)."""

    train_path: str | None = None
    """Training prompts: a ``.jsonl`` / ``.json`` (JSON lines) or ``.parquet`` file."""
    eval_path: str | None = None
    """Held-out prompts for eval, in the same formats."""
    format: str = "auto"
    """``auto`` (by the file's extension), ``jsonl`` or ``parquet``."""
    prompt_key: str | None = "prompt"
    """Field of a text prompt; null reads no text prompts (for files whose records also hold messages)."""
    messages_key: str | None = "messages"
    """Field of a chat prompt, ``[{"role": ..., "content": ...}, ...]``; a last message from the assistant
    is the reference response when the record has no ``response_key``. Null reads no chat prompts."""
    response_key: str = "response"
    """Field of an optional reference response (off-policy and SFT modes)."""
    answer_key: str = "answer"
    """Field of an optional reference answer (eval scorers such as exact match); a string or an integer."""
    group_key: str | None = None
    """Field naming each record's group (e.g. its task), a string or an integer: eval also reports accuracy per
    group (``eval/accuracy/<group>``), and ``teacher_mix.mode=route`` sends each record to the teacher named by it."""
    chat_template: str = "auto"
    """``auto`` (the tokenizer's template if it has one, else raw text), ``none`` (raw text) or the path of a
    ``.jinja`` file that replaces the tokenizer's template."""
    max_prompt_length: int = 1024
    """Longest prompt in tokens after the chat template; longer prompts are dropped and counted."""
    max_response_length: int | None = None
    """Longest reference response in tokens (its EOS included); longer records are dropped and counted."""
    shuffle: bool = True
    """Visit the training prompts in a new order every epoch (a permutation fixed by ``seed`` and epoch)."""
    seed: int = 1234
    max_bad_fraction: float = 0.01
    """Loading fails (with counts, reasons and examples) when more than this fraction of records is
    malformed; below it, malformed records are skipped and reported."""
    num_eval_prompts: int | None = None
    """Use at most the first N eval records that survive filtering."""

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r}; choose one of {list(FORMATS)}")
        for key in ("train_path", "eval_path"):
            path = getattr(self, key)
            if path is not None:
                resolve_format(path, self.format, key=f"data.{key}")
        if not self.prompt_key and not self.messages_key:
            raise ValueError("data.prompt_key and data.messages_key are both null; set at least one of them "
                             "to the field that holds the prompts")
        for key in ("response_key", "answer_key"):
            if not getattr(self, key):
                raise ValueError(f"data.{key} is empty; name the field (it may be absent from the records)")
        named = {key: getattr(self, key) for key in ("prompt_key", "messages_key", "response_key", "answer_key")
                 if getattr(self, key)}
        if len(set(named.values())) < len(named):
            raise ValueError(f"data: two fields share one name ({named}); give each its own field")
        if self.chat_template not in CHAT_TEMPLATE_MODES and not self.chat_template.endswith(".jinja"):
            raise ValueError(f"data.chat_template={self.chat_template!r}; choose 'auto', 'none' or the path of "
                             "a .jinja template file")
        if self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {self.max_prompt_length}")
        if self.max_response_length is not None and self.max_response_length < 1:
            raise ValueError(f"data.max_response_length must be >= 1 or null (no limit), got "
                             f"{self.max_response_length}")
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(f"data.max_bad_fraction must lie in [0, 1], got {self.max_bad_fraction}")
        if self.num_eval_prompts is not None and self.num_eval_prompts < 1:
            raise ValueError(f"data.num_eval_prompts must be >= 1 or null (all), got {self.num_eval_prompts}")


def resolve_format(path: str, format: str, *, key: str = "path") -> str:
    """``jsonl`` or ``parquet`` for ``path``: ``format`` itself, or by extension when it is ``auto``."""
    if format != "auto":
        return format
    suffix = pathlib.Path(path).suffix.lower()
    if suffix not in EXTENSIONS:
        raise ValueError(f"{key}={path!r}: cannot tell the format from the extension {suffix!r}; use one of "
                         f"{sorted(EXTENSIONS)} or set data.format to 'jsonl' or 'parquet'")
    return EXTENSIONS[suffix]

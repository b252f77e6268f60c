"""The student's tokenizer and chat template applied to prompts and reference responses."""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib

import jinja2

from megatron_gkd.data.config import DataConfig
from megatron_gkd.data.readers import Malformed
from megatron_gkd.data.records import ParsedRecord
from megatron_gkd.models.checkpoints import resolve_checkpoint

logger = logging.getLogger(__name__)

_PROBE = [{"role": "user", "content": "hello"}]


def pad_id(tokenizer) -> int:
    """The tokenizer's padding id, 0 when it has none (padding is masked everywhere, so any id serves)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def load_tokenizer(path: str):
    """The Hugging Face tokenizer in ``path`` (a model directory, a GGUF file, or a Hub id).

    Raises:
        ValueError: nothing loadable there, with what to point at instead.
    """
    from transformers import AutoTokenizer

    path = resolve_checkpoint(path)  # a GGUF: the tokenizer and chat template of its conversion
    local = pathlib.Path(path).expanduser()
    looks_local = local.is_absolute() or path.startswith((".", "~")) or local.exists()
    if looks_local and not local.is_dir():
        raise ValueError(f"tokenizer path {path!r} is not a directory; point it at a Hugging Face model "
                         "directory that holds tokenizer.json (or tokenizer_config.json and its vocabulary)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if looks_local else path)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {error}. Point the tokenizer path at a Hugging "
                         "Face model directory that holds tokenizer.json (nothing is downloaded on machines "
                         "without internet access)") from error
    if not tokenizer.is_fast:
        logger.warning("tokenizer %s is a slow (Python) tokenizer: tokenizing large prompt files will be slow",
                       path)
    return tokenizer


def resolve_chat_template(config: DataConfig, tokenizer) -> str | None:
    """The jinja template prompts go through, or ``None`` for raw text.

    Raises:
        ValueError: the template file is missing or the template does not render a plain user message.
    """
    if config.chat_template == "none":
        return None
    if config.chat_template == "auto":
        if tokenizer.chat_template is None:
            return None
        source = "the tokenizer's chat template"
        try:  # a tokenizer may carry several named templates; this is the one it would use itself
            template = tokenizer.get_chat_template()
        except ValueError as error:
            raise ValueError(f"{source}: {error}; set data.chat_template to the path of a .jinja file") from error
    else:
        path = pathlib.Path(config.chat_template).expanduser()
        if not path.is_file():
            raise ValueError(f"data.chat_template={config.chat_template!r} does not exist; give the path of a "
                             "readable .jinja file, 'auto' or 'none'")
        template = path.read_text()
        source = f"data.chat_template={config.chat_template!r}"
    # Rendering a user message once turns a broken template into one error instead of every record failing.
    try:
        tokenizer.apply_chat_template(_PROBE, chat_template=template, tokenize=False, add_generation_prompt=True)
    except (jinja2.TemplateError, ValueError, TypeError) as error:
        raise ValueError(f"{source} does not render a single user message: {error}; fix the template or set "
                         "data.chat_template=none for raw text") from error
    return template


def prompt_conversation(record: ParsedRecord, template: str | None) -> str | list[dict[str, str]]:
    """What a prompt is rendered from: its raw text when there is no template, else the messages the template reads
    (a text prompt as one user message). A teacher of another tokenizer renders the same conversation its own way
    (:mod:`megatron_gkd.teacher.clients.cross_prompt`).

    Raises:
        ValueError: the record holds chat messages and there is no template.
    """
    if template is None:
        if record.messages is not None:
            raise ValueError(f"row {record.index} holds chat messages but there is no chat template (the "
                             "tokenizer has none, or data.chat_template=none); set data.chat_template to the "
                             "path of a .jinja template file")
        return record.text
    return record.messages if record.messages is not None else [{"role": "user", "content": record.text}]


def render_prompt(record: ParsedRecord, template: str | None, tokenizer) -> str | Malformed:
    """The prompt text the model sees: the raw text, or the conversation through ``template`` followed
    by the assistant's generation prompt."""
    conversation = prompt_conversation(record, template)
    return conversation if template is None else render_messages(conversation, template, tokenizer)


def render_messages(messages: list[dict[str, str]], template: str, tokenizer) -> str | Malformed:
    """``messages`` through ``template``, followed by the assistant's generation prompt."""
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except (jinja2.TemplateError, ValueError, TypeError) as error:
        return Malformed("chat template error", str(error))


def tokenize_texts(tokenizer, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of ``texts``, tokenized in one batch (a fast tokenizer spreads it over threads)."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=add_special_tokens, return_attention_mask=False)["input_ids"]


def tokenizer_digest(tokenizer) -> str:
    """SHA-256 of the tokenizer's ``token -> id`` map (sorted by id), independent of file layout."""
    vocab = tokenizer.get_vocab()
    items = sorted(vocab.items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def stop_token_ids(configured, tokenizer) -> tuple[int, ...]:
    """The ids that end a response: ``configured`` (``rollout.stop_token_ids``) plus the tokenizer's EOS (engines are
    given token ids, not text)."""
    ids = [int(i) for i in configured]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(ids)


def eos_token_id(tokenizer) -> int:
    """The id reference responses end with.

    Raises:
        ValueError: the tokenizer defines no EOS token.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token, so reference responses cannot be terminated; use the "
                         "student's own tokenizer (its tokenizer_config.json names eos_token)")
    return int(tokenizer.eos_token_id)

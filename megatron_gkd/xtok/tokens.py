"""Each token of a tokenizer as the bytes of text it stands for: the common ground of two tokenizers.

Two tokenizers agree on text, not on ids or on how a token is spelt inside the vocabulary. The spellings differ
by family, so every token is first turned into the bytes it writes (its "piece"):

| quirk | spelt in the vocabulary | piece |
|---|---|---|
| GPT-2 byte-level BPE (decoder ``ByteLevel``) | ``Ġthe``, ``âĢ`` (one char per byte) | ``b" the"``, ``b"\\xe2\\x80"`` |
| SentencePiece / metaspace (``Metaspace`` or ``Replace('▁', ' ')``) | ``▁the`` | ``b" the"`` |
| byte fallback (``<0xE2>`` with ``byte_fallback``) | ``<0xE2>`` | ``b"\\xe2"`` (one byte of a UTF-8 char) |
| WordPiece continuation (decoder ``WordPiece``) | ``##ing`` | ``b"ing"`` |
| special tokens (``added_tokens`` with ``special``) | ``</s>``, ``<|im_end|>`` | ``b""``, flagged ``special`` |
| other added tokens | ``<think>`` | their content |
| the unknown token (``unk_token``) | ``<unk>`` | ``b""``, not special: it stands for text, only offsets say which |

Pieces are bytes, not ``str``: a byte-level or byte-fallback token can hold part of a multi-byte character (an
emoji is four tokens in some vocabularies), which no ``str`` can hold. The rules are read from the fast
tokenizer's own JSON (``Tokenizer.to_str()``: the model, its decoder, its added tokens), so they are the
tokenizer's, not guessed from the strings; a tokenizer without a fast backend falls back to decoding each id
(``decode([i])``), which cannot see partial characters (they come back as U+FFFD) and is flagged
``from_decode``.

Normalisers (lower-casing, NFKC) and WordPiece's dropped whitespace make the pieces of a text differ from the
text itself; the aligner then uses the fast tokenizer's offsets instead (:mod:`.align`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np

from megatron_gkd.data.tokenization import tokenizer_digest

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the byte-level pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


_BYTE_TO_UNICODE = _bytes_to_unicode()
_UNICODE_TO_BYTE = {char: byte for byte, char in _BYTE_TO_UNICODE.items()}


def backend(tokenizer: Any):
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` (a transformers fast tokenizer or the core itself), or
    None for a slow tokenizer."""
    core = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return core if hasattr(core, "to_str") and hasattr(core, "encode_batch") else None


def _decoder_kinds(decoder: dict | None) -> list[dict]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [kind for part in decoder.get("decoders", []) for kind in _decoder_kinds(part)]
    return [decoder]


@dataclasses.dataclass(frozen=True, slots=True)
class TokenTable:
    """Every id of one tokenizer as the bytes it writes.

    Attributes:
        pieces: ``[vocab]`` the bytes each id writes (``b""`` for special tokens and holes in the id range).
        special: ``[vocab]`` bool, ids that write no text (special tokens: BOS/EOS, chat-template markers).
        byte_tokens: ``[vocab]`` bool, ids that stand for one raw byte (byte fallback ``<0xNN>``); byte-level
            BPE tokens are not flagged (their pieces are exact bytes anyway).
        vocab_size: ids ``[0, vocab_size)``, added tokens included (the tokenizer's size, not the embedding's).
        digest: the tokenizer's identity (:func:`megatron_gkd.data.tokenization.tokenizer_digest`, the digest the
            teacher's INFO and the teacher cache carry).
        from_decode: the pieces came from ``decode([id])`` (no fast backend): partial characters are lost.
        byte_level, space_mark: the tokenizer's alphabet (GPT-2 bytes; the character standing for a space), for
            :meth:`spell`.
        lengths: ``[vocab]`` int64 byte length of each piece (derived).
    """

    pieces: tuple[bytes, ...]
    special: np.ndarray
    byte_tokens: np.ndarray
    vocab_size: int
    digest: str
    from_decode: bool = False
    byte_level: bool = False
    space_mark: str | None = None
    lengths: np.ndarray = dataclasses.field(init=False)

    def __post_init__(self):
        lengths = np.fromiter(map(len, self.pieces), dtype=np.int64, count=len(self.pieces))
        object.__setattr__(self, "lengths", lengths)  # [vocab] byte length of each piece, for vectorised spans

    def spell(self, piece: bytes) -> str | None:
        """``piece`` in this tokenizer's own alphabet (what its model's merges apply to: ``Ġ`` and one char per
        byte for byte-level BPE, ``▁`` for a metaspace one), or None where text cannot hold it (part of a
        character outside byte-level BPE)."""
        if self.byte_level:
            return "".join(_BYTE_TO_UNICODE[byte] for byte in piece)
        try:
            text = piece.decode()
        except UnicodeDecodeError:
            return None
        return text.replace(" ", self.space_mark) if self.space_mark else text

    def text(self, ids) -> bytes:
        """The bytes ``ids`` write (special tokens write nothing)."""
        pieces = self.pieces
        return b"".join([pieces[i] for i in ids])


def token_table(tokenizer: Any) -> TokenTable:
    """Reads every id of ``tokenizer`` (a ``tokenizers.Tokenizer`` or a transformers tokenizer) as its bytes."""
    core = backend(tokenizer)
    if core is None:
        return _table_from_decode(tokenizer)
    spec = json.loads(core.to_str())
    model = spec.get("model") or {}
    decoders = _decoder_kinds(spec.get("decoder"))
    kinds = {part.get("type") for part in decoders}
    byte_level = "ByteLevel" in kinds
    byte_fallback = bool(model.get("byte_fallback")) or "ByteFallback" in kinds
    metaspace = [part.get("replacement", "▁") for part in decoders if part.get("type") == "Metaspace"]
    metaspace += [part["pattern"].get("String") for part in decoders if part.get("type") == "Replace"
                  and part.get("content") == " " and isinstance(part.get("pattern"), dict)]
    metaspace = [mark for mark in metaspace if mark]
    wordpiece = [part.get("prefix", "##") for part in decoders if part.get("type") == "WordPiece"]
    added = {entry["id"]: entry for entry in spec.get("added_tokens", [])}
    unknown = model.get("unk_token")
    if isinstance(unknown, int):  # Unigram stores the unk token's id, BPE and WordPiece its string
        unknown = core.id_to_token(unknown)

    vocab = core.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1 if vocab else 0
    pieces: list[bytes] = [b""] * size
    special = np.zeros(size, dtype=bool)
    byte_tokens = np.zeros(size, dtype=bool)
    for token, index in vocab.items():
        if token == unknown:  # text the vocabulary cannot spell: it writes something, we cannot know what
            continue
        entry = added.get(index)
        if entry is not None and entry.get("special"):
            special[index] = True
            continue
        if entry is not None:  # an added non-special token writes its content as it is
            pieces[index] = token.encode()
            continue
        match = _BYTE_FALLBACK.match(token) if byte_fallback else None
        if match:
            pieces[index] = bytes([int(match.group(1), 16)])
            byte_tokens[index] = True
        elif byte_level and all(char in _UNICODE_TO_BYTE for char in token):
            pieces[index] = bytes(_UNICODE_TO_BYTE[char] for char in token)
        else:
            for mark in metaspace:
                token = token.replace(mark, " ")
            for prefix in wordpiece:
                if token.startswith(prefix):
                    token = token[len(prefix):]
            pieces[index] = token.encode()
    present = np.zeros(size, dtype=bool)
    present[np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))] = True
    special |= ~present  # holes in the id range write nothing, like special tokens
    return TokenTable(pieces=tuple(pieces), special=special, byte_tokens=byte_tokens, vocab_size=size,
                      digest=tokenizer_digest(tokenizer), byte_level=byte_level,
                      space_mark=metaspace[0] if metaspace else None)


def _table_from_decode(tokenizer: Any) -> TokenTable:
    """Slow-tokenizer fallback: ``decode([id])`` per id; special ids from ``all_special_ids``."""
    size = len(tokenizer)
    special = np.zeros(size, dtype=bool)
    special[[i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < size]] = True
    pieces = tuple(b"" if special[i] else tokenizer.decode([i]).encode() for i in range(size))
    return TokenTable(pieces=pieces, special=special, byte_tokens=np.zeros(size, dtype=bool), vocab_size=size,
                      digest=tokenizer_digest(tokenizer), from_decode=True)

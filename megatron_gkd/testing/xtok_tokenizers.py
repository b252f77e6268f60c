"""Small tokenizers of different families, trained here on generated text, for the cross-tokenizer tests and
benchmark (nothing is downloaded). Each has the quirk of a real family:

| name | model | pre-tokenizer / normaliser | quirk it stands for |
|---|---|---|---|
| ``bytelevel_digits`` | BPE | GPT-2 byte-level, one digit per token | Qwen / GPT-2 (``Ġ``, partial UTF-8 bytes) |
| ``metaspace_numbers`` | BPE, ``byte_fallback`` | ``▁`` metaspace, numbers kept whole | Llama-2 / SentencePiece (``<0xF0>``) |
| ``wordpiece_lower`` | WordPiece | BERT: lower-case, whitespace dropped | a normaliser (offsets needed) |
| ``unigram`` | Unigram | ``▁`` metaspace | SentencePiece unigram (T5-style) |
"""

from __future__ import annotations

import json
import random

SPECIALS = ["<pad>", "<s>", "</s>"]
WORDS = ("the a of to and is in it that for on with as was he she they we you at by from or an be this have "
         "not are but had his her which one all were there when can been has more if will would who so no "
         "answer sum plus equals number value total result first second third question think step").split()
EXTRA = ["café", "naïve", "über", "日本語", "中文", "😀", "🚀", "👍🏽", "—", "€", "ß", "Ω"]


def generated_text(num_lines: int, *, seed: int, exotic: bool = True) -> list[str]:
    """Lines of words, numbers of 1-6 digits, punctuation, whitespace runs and (``exotic``) multi-byte text."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        parts = []
        for _ in range(rng.randint(4, 16)):
            roll = rng.random()
            if roll < 0.25:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 6))))
            elif roll < 0.3 and exotic:
                parts.append(rng.choice(EXTRA))
            elif roll < 0.35:
                parts.append(rng.choice([",", ".", "?", "!", ":", "+", "=", "(", ")"]))
            else:
                parts.append(rng.choice(WORDS).capitalize() if rng.random() < 0.1 else rng.choice(WORDS))
        lines.append("".join(part + rng.choice([" ", " ", " ", "  ", "\n", "\t"]) for part in parts).rstrip())
    return lines


def bytelevel_digits(texts: list[str], vocab_size: int = 400):
    """Byte-level BPE that writes one digit per token (GPT-2 / Qwen style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False)])
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    return core


def metaspace_numbers(texts: list[str], vocab_size: int = 400):
    """SentencePiece-style BPE (``▁``) with byte fallback; numbers are not split into digits, so common ones
    become single tokens (Llama's numerals). Its alphabet is what ``texts`` hold: train it on text without
    emoji and they come out as ``<0xNN>`` byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                        show_progress=False))
    spec = json.loads(core.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    core = Tokenizer.from_str(json.dumps(spec))
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    return core


def wordpiece_lower(texts: list[str], vocab_size: int = 400):
    """BERT-style WordPiece: lower-cases and drops whitespace (only its offsets locate its tokens)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    core = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.decoder = decoders.WordPiece()
    core.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "</s>"],
                                                              show_progress=False))
    return core


def unigram(texts: list[str], vocab_size: int = 400):
    """SentencePiece-style Unigram with ``▁`` and an unknown token for characters it never saw."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.Unigram())
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    core.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + ["<unk>"],
                                                            unk_token="<unk>", show_progress=False))
    return core

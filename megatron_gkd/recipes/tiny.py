"""Tiny assets the project builds itself (nothing can be downloaded here): a word-level tokenizer, a
random Qwen3 teacher and a smaller random Qwen3 student sharing it (or, with ``moe=True``, a random
Qwen3-MoE student: 4 experts, top-2), and JSONL prompt files.

The trainer's e2e tests and benchmarks build them once into ``outputs/tiny_assets`` and distil the student
from the teacher on them (``configs/cpu_tiny.yaml``): a real run of every part of the trainer on 2 CPU
cores in a few minutes (the distillation demo replaces the random teacher with a trained one)::

    python -m megatron_gkd.recipes.tiny --out outputs/tiny_assets
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib

import numpy as np
import torch

from megatron_gkd.log_setup import setup_logging

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
BOS_ID, EOS_ID = 1, 2
# A chat template for the tiny tokenizer (``data.chat_template``): its markup is special tokens and it ends in one,
# as real templates end in ``<|im_start|>assistant\n`` (the tiny vocabulary has no role words).
CHAT_TEMPLATE = ("{% for message in messages %}<s> {{ message['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s>{% endif %}")


def build_tokenizer(directory: str | pathlib.Path, vocab_size: int = 512, chat_template: str | None = None):
    """A word-level tokenizer ``<unk> <s> </s> w0 .. w{vocab_size-4}`` saved in HF format (with ``chat_template``,
    e.g. :data:`CHAT_TEMPLATE`, if given); returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<unk>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return tokenizer


def build_checkpoint(directory: str | pathlib.Path, *, vocab_size: int = 512, hidden_size: int = 128,
                     num_layers: int = 2, num_heads: int = 2, num_kv_heads: int = 2, intermediate_size: int = 256,
                     seed: int = 0, init_std: float = 0.2, num_experts: int = 0, num_experts_per_tok: int = 2,
                     router_aux_loss_coef: float = 0.01) -> pathlib.Path:
    """A random ``Qwen3ForCausalLM`` (head_dim 64: vLLM's CPU attention needs 32/64/128) in HF format; with
    ``num_experts > 0`` a ``Qwen3MoeForCausalLM`` whose every layer routes to ``num_experts_per_tok`` of
    ``num_experts`` experts of width ``intermediate_size`` (renormalised top-k, load-balancing loss weight
    ``router_aux_loss_coef``).

    A wide initialisation spreads the logits, so the distributions have structure to distil.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  head_dim=64, max_position_embeddings=1024, initializer_range=init_std, tie_word_embeddings=False,
                  bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    if num_experts:
        config = Qwen3MoeConfig(**common, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                                moe_intermediate_size=intermediate_size, norm_topk_prob=True,
                                router_aux_loss_coef=router_aux_loss_coef)
        model = Qwen3MoeForCausalLM(config).eval()
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    model.save_pretrained(directory)
    return pathlib.Path(directory)


def write_prompts(path: str | pathlib.Path, num_prompts: int, *, vocab_size: int = 512, seed: int = 0,
                  min_words: int = 3, max_words: int = 12) -> pathlib.Path:
    """JSONL prompts of random words, each with a reference response and an answer (the prompt's first
    word; a random teacher will not know it, but the scorer and the SFT/off-policy modes have data)."""
    rng = np.random.default_rng(seed)
    words = vocab_size - len(SPECIAL_TOKENS)
    path = pathlib.Path(path)
    with path.open("w") as handle:
        for _ in range(num_prompts):
            prompt = [f"w{i}" for i in rng.integers(0, words, rng.integers(min_words, max_words + 1))]
            response = [f"w{i}" for i in rng.integers(0, words, rng.integers(2, 8))]
            handle.write(json.dumps({"prompt": " ".join(prompt), "response": " ".join(response),
                                     "answer": prompt[0]}) + "\n")
    return path


def build_assets(out: str | pathlib.Path, *, vocab_size: int = 512, num_train: int = 256, num_eval: int = 32,
                 moe: bool = False) -> pathlib.Path:
    """``tokenizer``, ``teacher`` (4 layers, 256 wide), ``student`` (2 layers, 128 wide; with ``moe`` a
    Qwen3-MoE of 4 experts 128 wide, top-2, in each layer), ``train.jsonl``, ``eval.jsonl`` under ``out``
    (skipped when ``out/READY`` exists)."""
    out = pathlib.Path(out)
    if (out / "READY").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    student = dict(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=128 if moe else 256, seed=2,
                   num_experts=4 if moe else 0)
    for name, size in (("teacher", dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512, seed=1)),
                       ("student", student)):
        build_checkpoint(out / name, vocab_size=vocab_size, **size)
        build_tokenizer(out / name, vocab_size)
    write_prompts(out / "train.jsonl", num_train, vocab_size=vocab_size, seed=3)
    write_prompts(out / "eval.jsonl", num_eval, vocab_size=vocab_size, seed=4)
    (out / "READY").write_text("tiny assets: tokenizer, teacher, student, train.jsonl, eval.jsonl\n")
    logger.info("tiny assets written to %s", out)
    return out


def _save_tokenizer(core, directory: str | pathlib.Path, chat_template: str | None = None):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<unk>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return tokenizer


def build_cross_teachers(assets: str | pathlib.Path, out: str | pathlib.Path, *, seed: int = 5,
                         chat_template: str | None = None) -> pathlib.Path:
    """Teachers of other tokenizers than the tiny assets' (``assets``, :func:`build_assets`) for cross-tokenizer runs,
    under ``out`` (skipped when ``out/READY`` exists):

    * ``permuted``: the tiny teacher itself behind a tokenizer that numbers the same words in another order (its
      embedding and output rows permuted with them) and keeps the student's chat template (``chat_template``, if
      given, replaces it). It is the same model over the same text, so a cross-tokenizer run against it must equal a
      same-tokenizer run against the tiny teacher (the map ``W`` is a permutation).
    * ``chars``: a random Qwen3 over a character tokenizer (``w``, the ten digits and the specials): every student
      word ``w123`` is several teacher tokens (1:n groups), whitespace dropped on both sides like the student's (so as
      a *student* it suits one-word responses only: its decoding joins the characters).
    """
    from safetensors.torch import load_file, save_file
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    assets, out = pathlib.Path(assets), pathlib.Path(out)
    if (out / "READY").exists():
        return out
    import shutil

    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(assets / "student")
    vocab = student.get_vocab()
    words = sorted((w for w in vocab if w not in SPECIAL_TOKENS), key=vocab.get)
    order = np.random.default_rng(seed).permutation(len(words))
    permuted = {word: i for i, word in enumerate(SPECIAL_TOKENS)}
    permuted.update({words[j]: len(SPECIAL_TOKENS) + i for i, j in enumerate(order)})
    core = Tokenizer(models.WordLevel(permuted, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    target = out / "permuted"
    shutil.copytree(assets / "teacher", target, dirs_exist_ok=True)
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (target / stale).unlink(missing_ok=True)
    _save_tokenizer(core, target, chat_template or student.chat_template)
    # Row of teacher id t = the tiny teacher's row of the word the permuted tokenizer numbers t.
    rows = torch.tensor([vocab[w] for w in sorted(permuted, key=permuted.get)], dtype=torch.int64)
    weights = target / "model.safetensors"
    tensors = load_file(weights)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        table = tensors[name]
        tensors[name] = torch.cat([table[rows], table[len(rows):]]).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})

    characters = SPECIAL_TOKENS + ["w"] + [str(d) for d in range(10)]
    core = Tokenizer(models.WordLevel({c: i for i, c in enumerate(characters)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                  pre_tokenizers.Split(Regex("."), behavior="isolated")])
    core.decoder = decoders.Fuse()  # characters decode joined ("w12"), not space-separated like words
    build_checkpoint(out / "chars", vocab_size=len(characters), hidden_size=128, num_layers=2, num_heads=2,
                     intermediate_size=256, seed=seed)
    _save_tokenizer(core, out / "chars")
    (out / "READY").write_text("cross-tokenizer teachers: permuted, chars\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/tiny_assets")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE student (4 experts, top-2)")
    args = parser.parse_args(argv)

    setup_logging("INFO")
    build_assets(args.out, moe=args.moe)


if __name__ == "__main__":
    main()

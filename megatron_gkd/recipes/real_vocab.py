"""Assets with a real model's vocabulary shape (issue #21): a tokenizer of 151,669 entries (Qwen3's), a
student whose tables hold 151,936 rows (Qwen3's padded embedding) and a teacher with 152,064 rows (a
Qwen2.5-72B-style table), so the two sides are padded differently past the tokenizer. Nothing is
downloaded: the tokenizer is the tiny recipe's word-level one at that size, with a chat template, and the
models are random Qwen3s of the tiny recipe's shapes but these tables::

    python -m megatron_gkd.recipes.real_vocab --out outputs/real_vocab_assets

The padding rows of the random tables are as likely as any other row (a trained model's are not), so a
run on these assets samples them, ranks them in the teacher's top-k and gives them mass unless the
trainer keeps them out: the worst case, on purpose.
"""

from __future__ import annotations

import argparse
import logging
import pathlib

from megatron_gkd.log_setup import setup_logging
from megatron_gkd.recipes import tiny

logger = logging.getLogger(__name__)

TOKENIZER_SIZE = 151_669
STUDENT_ROWS = 151_936
TEACHER_ROWS = 152_064
# A one-turn template: the user's words, then the assistant's turn (the tokenizer splits on whitespace).
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<s> {% endif %}")


def build_assets(out: str | pathlib.Path, *, num_train: int = 64, num_eval: int = 16) -> pathlib.Path:
    """``teacher``, ``student`` (each with the tokenizer), ``train.jsonl``, ``eval.jsonl`` under ``out``
    (skipped when ``out/READY`` exists)."""
    out = pathlib.Path(out)
    if (out / "READY").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name, rows, size in (
            ("teacher", TEACHER_ROWS, dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512, seed=1)),
            ("student", STUDENT_ROWS, dict(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, seed=2))):
        tiny.build_checkpoint(out / name, vocab_size=rows, **size)
        tokenizer = tiny.build_tokenizer(out / name, TOKENIZER_SIZE)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(out / name)
    tiny.write_prompts(out / "train.jsonl", num_train, vocab_size=TOKENIZER_SIZE, seed=3)
    tiny.write_prompts(out / "eval.jsonl", num_eval, vocab_size=TOKENIZER_SIZE, seed=4)
    (out / "READY").write_text(f"real-vocabulary assets: tokenizer {TOKENIZER_SIZE}, student {STUDENT_ROWS} rows, "
                               f"teacher {TEACHER_ROWS} rows\n")
    logger.info("real-vocabulary assets written to %s", out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/real_vocab_assets")
    args = parser.parse_args(argv)

    setup_logging("INFO")
    build_assets(args.out)


if __name__ == "__main__":
    main()

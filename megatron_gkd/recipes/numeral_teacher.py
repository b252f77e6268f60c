"""The cross-tokenizer experiment's teacher (issue #29 point 5): the demo's teacher (the same shape, the same SFT
recipe, the same addition task) over a tokenizer that writes the answer as ONE token, the case of a Llama-style
teacher (numbers in chunks of up to three digits) distilled into a Qwen-style student (one token per digit), which
breaks a comparison of the two models position by position.

The task's text is unchanged (``4 2 2 + 6 8 7 =`` -> ``9 0 1 1 #### 1 1 0 9``): the numeral tokenizer reads the
spaced digits of the number after the marker as one token (``"1 1 0 9"``) and every other digit alone, so the teacher
and the demo's student write the same text with other boundaries at the answer (one teacher token for 1-4 student
tokens: n:1 groups, the tokens the task's scorer checks). Its vocabulary is the ten digits, every number 0..1999 as the
task spells it, ``+``, ``=``, ``####`` and the specials, so nothing in the task is unknown to it.

Why not every number: a teacher of this shape trained the same way with every number one token (the operands and the
worked sum too) did not learn the addition (0.008 held-out accuracy after 2,000 of 4,000 SFT steps, loss 1.29 at
2,300): the sum of two whole-number tokens is a lookup over a million pairs that 20,000 problems do not teach, while
copying the worked digits into one answer token is.

    python -m megatron_gkd.recipes.numeral_teacher    # about 5 minutes on 2 CPU cores; writes assets/xtok/numeral_teacher
"""

from __future__ import annotations

import argparse
import logging
import pathlib

from megatron_gkd.log_setup import setup_logging
from megatron_gkd.recipes import arithmetic, demo

logger = logging.getLogger(__name__)

DEST = demo.REPO / "assets" / "xtok" / "numeral_teacher"


def numeral_words(limit: int = 2000) -> list[str]:
    """Every number below ``limit`` as the task spells it (spaced digits), the single digits first."""
    return [arithmetic._spell(n) for n in range(limit)]


def build_numeral_tokenizer(directory: str | pathlib.Path):
    """A word-level tokenizer whose pre-tokenizer keeps the spaced digits after the marker together (the other
    symbols are split at spaces); saved in HF format."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = arithmetic.SPECIAL_TOKENS + numeral_words() + ["+", "=", arithmetic.MARKER]
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    # The matches are the tokens (the answer's spaced digits, or a run of other symbols); the spaces between go.
    answer = rf"(?<={arithmetic.MARKER} )\d(?: \d)*"
    core.pre_tokenizer = pre_tokenizers.Split(Regex(answer + r"|\S+"), behavior="removed", invert=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<unk>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="outputs/numeral_build", help="task files, initial weights, the SFT run")
    parser.add_argument("--dest", default=str(DEST))
    parser.add_argument("overrides", nargs="*", help="extra config overrides of the SFT run")
    args = parser.parse_intermixed_args(argv)

    setup_logging("INFO")
    demo.train("teacher", pathlib.Path(args.work).resolve(), pathlib.Path(args.dest), args.overrides,
               tokenizer=build_numeral_tokenizer)


if __name__ == "__main__":
    main()

"""The cross-tokenizer experiment's teacher (issue #29 point 5): the demo's teacher (the same shape, the same SFT
recipe, the same addition task) over a tokenizer that writes every number as ONE token, the case of a Llama-style
teacher (numbers in chunks of up to three digits) distilled into a Qwen-style student (one token per digit), which
breaks a comparison of the two models position by position.

The task's text is unchanged (``4 2 2 + 6 8 7 =`` -> ``9 0 1 1 #### 1 1 0 9``): the numeral tokenizer reads the
spaced digits of a number as one token (``"4 2 2"``), so the teacher and the demo's student write the same text with
other boundaries (one teacher token per 1-4 student tokens: n:1 groups). Its vocabulary is every number 0..1999 as
written forwards and backwards (the worked part writes sums from the units up, zeros first: ``"0 0 1"``), ``+``,
``=``, ``####`` and the specials, so nothing in the task is unknown to it.

    python -m megatron_gkd.recipes.numeral_teacher    # about 8 minutes on 2 CPU cores; writes assets/xtok/numeral_teacher
"""

from __future__ import annotations

import argparse
import logging
import pathlib

from megatron_gkd.recipes import arithmetic, demo

logger = logging.getLogger(__name__)

DEST = demo.REPO / "assets" / "xtok" / "numeral_teacher"


def numeral_words(limit: int = 2000) -> list[str]:
    """Every number below ``limit`` as the task spells it (spaced digits), forwards and reversed (the worked part)."""
    spelled = {arithmetic._spell(n) for n in range(limit)}
    spelled |= {" ".join(reversed(word.split(" "))) for word in spelled}
    return sorted(spelled, key=lambda word: (len(word), word))


def build_numeral_tokenizer(directory: str | pathlib.Path):
    """A word-level tokenizer whose pre-tokenizer keeps each run of spaced digits together; saved in HF format."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = arithmetic.SPECIAL_TOKENS + numeral_words() + ["+", "=", arithmetic.MARKER]
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    # The matches are the tokens (a number's spaced digits, or a run of other symbols); the spaces between go.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d(?: \d)*|[^\s\d]+"), behavior="removed", invert=True)
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
    from megatron_gkd.log_setup import setup_logging

    setup_logging("INFO")
    demo.train("teacher", pathlib.Path(args.work).resolve(), pathlib.Path(args.dest), args.overrides,
               tokenizer=build_numeral_tokenizer)


if __name__ == "__main__":
    main()

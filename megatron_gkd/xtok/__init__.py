"""Cross-tokenizer distillation, the CPU side: each tokenizer's tokens as bytes (:mod:`.tokens`) and the alignment
of two tokenisations of one response (:mod:`.align`). The loss that consumes the projection map is
:mod:`megatron_gkd.losses.cross_vocab`."""

from megatron_gkd.xtok.align import Alignment, Kind, align_ids, align_spans, align_text
from megatron_gkd.xtok.tokens import TokenTable, token_table

__all__ = ["Alignment", "Kind", "TokenTable", "align_ids", "align_spans", "align_text", "token_table"]

"""Cross-tokenizer distillation, the CPU side: each tokenizer's tokens as bytes (:mod:`.tokens`), the alignment of
two tokenisations of one response (:mod:`.align`) and the sparse student -> teacher projection map
(:mod:`.projection`). The loss that consumes the map is :mod:`megatron_gkd.losses.cross_vocab.loss`."""

from megatron_gkd.xtok.align import Alignment, Kind, align_ids, align_spans, align_text
from megatron_gkd.xtok.projection import ProjectionMap, build_projection
from megatron_gkd.xtok.tokens import TokenTable, token_table

__all__ = ["Alignment", "Kind", "ProjectionMap", "TokenTable", "align_ids", "align_spans", "align_text",
           "build_projection", "token_table"]

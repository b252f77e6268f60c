"""What a parallel layout asks of a model's shape, checked on its ``config.json`` before anything is built.

Megatron-Core splits a model in whole units. A size that does not divide used to fail after start-up (an
assertion in its layer builder, or this project's builder after the teacher service and the data were up).
:func:`check_split` is the one place that checks them: the dry run and the trainer's start
(``megatron_gkd.config.checkpoints``), the model builder (``models.builder.transformer_config``) and the memory
planner all call it. It reads only the :class:`~megatron_gkd.planning.model.ModelShape` (no torch), so a dry run
checks a checkpoint's layout on a laptop.

| unit | a multiple of | why |
|---|---|---|
| attention heads, key/value heads | TP | a rank computes whole heads with its own key/value heads (the mapping does not |
| | | replicate a key/value head over ranks, as vLLM does when TP exceeds them) |
| vocabulary rows | TP | the table is split as the checkpoint stores it: no rows are added (Megatron-LM pads to |
| | | ``make_vocab_size_divisible_by`` x TP), so exports, weight syncs and teacher heads see its rows |
| layers | PP x VPP | Megatron-Core gives every stage and chunk the same number of layers |
| routed experts | EP | a rank holds whole experts |

Tied embeddings over several pipeline stages are supported, and :meth:`ModelSplit.describe` says how: the last
stage keeps its own copy of the embedding as its output layer, and Megatron-Core keeps the two equal (both copies
train as the single stage's one table: ``tests/distributed/trainer/test_tied_pipeline.py``).
"""

from __future__ import annotations

import dataclasses
import math

from megatron_gkd.planning.model import ModelShape


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(*counts: int) -> str:
    """The sizes that divide every one of ``counts``: ``"1, 2 or 4"``."""
    found = [str(d) for d in _divisors(math.gcd(*counts))]
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} or {found[-1]}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelSplit:
    """How a layout splits one model; made by :func:`check_split`, which has checked that every unit divides."""

    shape: ModelShape
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1
    """Model chunks per stage (1 without an interleaved schedule)."""
    expert_model_parallel_size: int = 1

    @property
    def tied_copy(self) -> bool:
        """The output layer sits on another stage than the tied embedding it shares, so the last stage holds a copy."""
        return self.shape.tie_word_embeddings and self.pipeline_model_parallel_size > 1

    @property
    def vocab_rows_per_rank(self) -> int:
        return self.shape.vocab_size // self.tensor_model_parallel_size

    def describe(self, world_size: int | None = None) -> list[str]:
        """What the layout does to the model: heads, layers and experts per rank, and a tied output layer's copy
        (with the embedding groups of ``world_size`` ranks, in Megatron's order: TP fastest, then DP, then PP)."""
        m, tp, pp, vpp = (self.shape, self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                          self.virtual_pipeline_model_parallel_size)
        heads = (f"{m.num_attention_heads} attention heads" if m.attention == "mla" else
                 f"{m.num_attention_heads} attention heads / {m.num_key_value_heads} key/value heads")
        per_rank = (f"{m.num_attention_heads // tp}" if m.attention == "mla" else
                    f"{m.num_attention_heads // tp} / {m.num_key_value_heads // tp}")
        text = (f"{m.architecture}: {heads} -> {per_rank} a TP rank; {m.num_layers} layers -> "
                f"{m.num_layers // (pp * vpp)} a {'chunk' if vpp > 1 else 'stage'}")
        if m.is_moe:
            text += f"; {m.num_experts} routed experts -> {m.num_experts // self.expert_model_parallel_size} an EP rank"
        lines = [text]
        if self.tied_copy:
            tied = (f"tied embeddings over {pp} stages: the last stage keeps its own copy of the embedding as its "
                    f"output layer ([{self.vocab_rows_per_rank}, {m.hidden_size}] a TP rank), loaded from the same HF "
                    "tensor; every step Megatron-Core all-reduces the two copies' gradients over the embedding group, "
                    "so they stay equal; the HF export and the weight sync send the first stage's table only")
            if world_size is not None:
                stride = world_size // pp  # ranks of one stage
                pairs = [f"({rank}, {rank + (pp - 1) * stride})" for rank in range(stride)]
                tied += (f"; embedding groups (first-stage rank, last-stage rank): {', '.join(pairs[:4])}"
                         + (f" and {len(pairs) - 4} more" if len(pairs) > 4 else ""))
            lines.append(tied)
        return lines

    def vocabulary(self, tokenizer_size: int | None, *, tokenizer_key: str = "the tokenizer") -> str:
        """The vocabulary's rows, padding rows and split, for a tokenizer of ``tokenizer_size`` ids (None: unknown).

        Raises:
            ValueError: the tokenizer defines ids past the table (they would have no embedding row).
        """
        rows = self.shape.vocab_size
        if tokenizer_size is not None and tokenizer_size > rows:
            raise ValueError(f"{tokenizer_key} has {tokenizer_size:,} ids but {self.shape.architecture}'s table has "
                             f"{rows:,} rows: ids past the table have no embedding; use the checkpoint's own "
                             "tokenizer, or resize the table (transformers: model.resize_token_embeddings(len(tokenizer)))")
        padding = "" if tokenizer_size is None else (
            f" for {tokenizer_size:,} tokenizer ids ("
            + (f"{rows - tokenizer_size:,} padding rows, ids {tokenizer_size:,}-{rows - 1:,}: left out of the losses' "
               "softmax and never sampled)" if rows > tokenizer_size else "no padding rows)"))
        return (f"vocabulary: {rows:,} rows{padding} -> {self.vocab_rows_per_rank:,} a TP rank; the run splits the "
                "checkpoint's table as stored (no rows added)")


def check_layers(num_layers: int, pipeline_model_parallel_size: int, virtual_pipeline_model_parallel_size: int = 1, *,
                 name: str = "the model", key: str = "") -> None:
    """Checks that ``num_layers`` split evenly over the stages and their chunks, as Megatron-Core splits them.

    Raises:
        ValueError: they do not; the message names the products that would work.
    """
    pp, vpp = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size
    if num_layers % (pp * vpp):
        raise ValueError(f"{name} has {num_layers} layers, which do not split into {key}pipeline_model_parallel_size="
                         f"{pp} x {key}virtual_pipeline_model_parallel_size={vpp} chunks of equal size; choose sizes "
                         f"whose product is {_choices(num_layers)}")


def check_split(
    m: ModelShape,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    name: str | None = None,
    key: str = "",
) -> ModelSplit:
    """Checks that the layout splits ``m`` in whole units (the table in the module docstring).

    Args:
        m: the model's shape (:func:`~megatron_gkd.planning.model.model_shape` of its ``config.json``).
        tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
            expert_model_parallel_size: the layout (Megatron's names).
        name: how messages name the model, e.g. ``"the student (LlamaForCausalLM)"``; default the architecture.
        key: the config section holding the sizes, as messages name them (``"parallel."``); default none.

    Returns:
        The :class:`ModelSplit`, which describes the split.

    Raises:
        ValueError: a unit does not divide; the message names both numbers and the sizes that would work.
    """
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    vpp = virtual_pipeline_model_parallel_size or 1
    name = name or m.architecture
    heads, groups, rows = m.num_attention_heads, m.num_key_value_heads, m.vocab_size
    if heads % tp or groups % tp:
        what = (f"{heads} attention heads" if m.attention == "mla" else
                f"{heads} attention heads and {groups} key/value heads")
        raise ValueError(f"{name} has {what}, which do not split across {key}tensor_model_parallel_size={tp} (a rank "
                         f"computes whole heads with its own key/value heads); set {key}tensor_model_parallel_size to "
                         f"{_choices(heads, groups, rows)} (the sizes that also split its {rows:,} vocabulary rows)")
    if rows % tp:
        raise ValueError(f"{name} has {rows:,} vocabulary rows, which do not split across "
                         f"{key}tensor_model_parallel_size={tp} (the run splits the checkpoint's table as stored, "
                         f"with no padding rows added); set {key}tensor_model_parallel_size to "
                         f"{_choices(heads, groups, rows)}, or pad the checkpoint's table to a multiple of {tp} rows "
                         f"as Megatron-LM does (transformers: model.resize_token_embeddings(len(tokenizer), "
                         f"pad_to_multiple_of={128 * tp}), then save_pretrained)")
    check_layers(m.num_layers, pp, vpp, name=name, key=key)
    if m.is_moe and m.num_experts % ep:
        raise ValueError(f"{name} has {m.num_experts} routed experts, which do not split across "
                         f"{key}expert_model_parallel_size={ep}; set it to {_choices(m.num_experts)}")
    return ModelSplit(shape=m, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                      virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep)

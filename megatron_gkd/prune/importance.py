"""Importance of layers, attention heads, MLP channels and hidden channels, measured on the Megatron model.

| what | measured on (Megatron module) | score (mean over calibration tokens) |
|---|---|---|
| layer, ``cosine`` (default) | a decoder layer's input and output hidden states | ``1 - cos(x_in, x_out)`` (ShortGPT's Block Influence) |
| layer, ``loss`` | the LM loss with the layer skipped (one more pass a layer) | ``loss without the layer - loss`` |
| query head | the input of ``linear_proj``: each head's attention output | its L2 norm over ``head_dim`` |
| MLP channel | the input of ``linear_fc2``: ``silu(gate) * up`` | ``abs`` |
| hidden channel | each layer's two norms' outputs, and the final norm's | ``abs``, summed over the norms of the layers kept |

The width scores are Minitron's activation-based ones (Muralidharan et al., 2024, "Compact Language Models via
Pruning and Knowledge Distillation"). ``cosine`` is the default depth score because one forward pass scores every
layer, whatever the depth; ``loss`` measures what depth pruning changes directly, at one more pass over the
calibration set per layer (on SmolLM2-135M: 12 s against 5.7 min, and its 10-of-30-layer student was 1 nat closer
to the teacher before distillation: docs/running.md, "Pruning").

Every statistic is a sum over calibration tokens, kept per rank in the whole model's shape: a tensor-parallel rank
fills the heads and MLP channels it holds (Megatron splits them in the HF order: whole query groups, contiguous MLP
channels), a pipeline stage the layers it holds, and only the first TP rank what every TP rank computes alike
(hidden states, norms, the loss). Data-parallel replicas score their own share of the sequences. One all-reduce
(sum) over every rank then gives every rank the whole model's sums, and dividing by the tokens the means.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import torch
import torch.distributed as dist
import tqdm

from megatron_gkd import platform
from megatron_gkd.models import unwrap
from megatron_gkd.parallel import eval_mode, run_schedule
from megatron_gkd.prune.targets import ModelSizes

logger = logging.getLogger(__name__)

DEPTH_METRICS = ("cosine", "loss")
# What every tensor-parallel rank computes alike: only the first TP rank's sums count.
_REPLICATED = ("cosine", "hidden", "final_hidden", "loss")


@dataclasses.dataclass(frozen=True)
class Importance:
    """Importance scores of the whole model (float64, on the host; the same on every rank)."""

    layers: torch.Tensor
    """``[L]``: the depth score of each layer (``depth_metric``); higher is more important."""
    heads: torch.Tensor
    """``[L, H]``: mean L2 norm of each query head's attention output."""
    ffn: torch.Tensor
    """``[L, F]``: mean absolute activation of each MLP channel."""
    hidden: torch.Tensor
    """``[L, h]``: mean absolute output of each layer's two norms per hidden channel (summed over the two)."""
    final_hidden: torch.Tensor
    """``[h]``: mean absolute output of the final norm per hidden channel."""
    loss: float
    """The unpruned model's LM loss on the calibration tokens."""
    depth_metric: str

    def hidden_scores(self, layers: list[int]) -> torch.Tensor:
        """``[h]``: the hidden channels' scores over the norms of ``layers`` and the final norm."""
        return self.hidden[layers].sum(dim=0) + self.final_hidden


def measure_importance(chunks, tokens: torch.Tensor, *, state, sizes: ModelSizes, depth_metric: str = "cosine",
                       micro_batch_size: int = 1) -> Importance:
    """Scores every layer and channel of the model on the calibration ``tokens`` (collective over every rank).

    Args:
        chunks: this rank's chunks, built with the local layer spec (the norms are modules of their own).
        tokens: ``[n, s]`` calibration tokens, the same on every rank; replica ``r`` scores rows ``r::dp``.
        state: the :class:`~megatron_gkd.parallel.ParallelState` the chunks were built on.
        sizes: the model's sizes.
        depth_metric: ``cosine`` or ``loss`` (module docstring).
        micro_batch_size: sequences per forward.

    Raises:
        ValueError: an unknown metric, a layout that splits the sequence, or fewer rows than replicas x micro-batch.
    """
    if depth_metric not in DEPTH_METRICS:
        raise ValueError(f"depth metric {depth_metric!r}; choose one of {list(DEPTH_METRICS)}")
    if state.config.context_parallel_size > 1 or state.config.sequence_parallel:
        raise ValueError("importance is measured on whole sequences; use context_parallel_size=1 and no sequence_parallel")
    microbatches, num_rows = _my_microbatches(tokens, state, micro_batch_size)
    num_tokens, num_label_tokens = num_rows * tokens.shape[1], num_rows * (tokens.shape[1] - 1)
    sums = _Sums(sizes, platform.device())
    bar = tqdm.tqdm(total=len(microbatches) * len(chunks), desc="calibration forward", unit="micro-batch",
                    disable=state.rank != 0)
    with _recording(chunks, sums, state), bar:
        sums.tensors["loss"] += _loss_sum(chunks, microbatches, bar)
    means = {name: value / num_tokens for name, value in sums.reduce(state).items()}
    loss = float(means.pop("loss")) * num_tokens / num_label_tokens
    if depth_metric == "cosine":
        layers = 1.0 - means["cosine"]
    else:
        layers = torch.zeros(sizes.num_layers, dtype=torch.float64)
        for index in tqdm.trange(sizes.num_layers, desc="layers skipped", disable=state.rank != 0):
            with _skipped(chunks, index):
                layers[index] = _reduced_loss(_loss_sum(chunks, microbatches), state) / num_label_tokens - loss
    logger.info("calibration loss %.4f over %d tokens; %s importance of the layers: %s", loss, num_tokens, depth_metric,
                " ".join(f"{value:.4g}" for value in layers.tolist()))
    return Importance(layers=layers, heads=means["heads"], ffn=means["ffn"], hidden=means["hidden"],
                      final_hidden=means["final_hidden"], loss=loss, depth_metric=depth_metric)


def _my_microbatches(tokens: torch.Tensor, state, micro_batch_size: int) -> tuple[list[torch.Tensor], int]:
    """This replica's micro-batches and the rows every replica scores together."""
    replicas = state.data_parallel_size
    usable = tokens.shape[0] - tokens.shape[0] % (replicas * micro_batch_size)
    if usable == 0:
        raise ValueError(f"{tokens.shape[0]} calibration sequences do not fill {replicas} data-parallel replica(s) x "
                         f"micro_batch_size {micro_batch_size}; give more --num-samples or a smaller micro-batch size")
    if usable < tokens.shape[0]:
        logger.warning("scoring %d of %d calibration sequences: a multiple of %d replica(s) x micro-batch size %d",
                       usable, tokens.shape[0], replicas, micro_batch_size)
    mine = tokens[:usable][state.dp_rank::replicas].to(platform.device())
    return list(mine.split(micro_batch_size)), usable


class _Sums:
    """This rank's float64 sums over its tokens, in the whole model's shape."""

    def __init__(self, sizes: ModelSizes, device: torch.device):
        layers, heads = sizes.num_layers, sizes.num_attention_heads
        shapes = dict(cosine=(layers,), heads=(layers, heads), ffn=(layers, sizes.ffn_hidden_size),
                      hidden=(layers, sizes.hidden_size), final_hidden=(sizes.hidden_size,), loss=())
        self.tensors = {name: torch.zeros(shape, dtype=torch.float64, device=device) for name, shape in shapes.items()}

    def reduce(self, state) -> dict[str, torch.Tensor]:
        """Every rank's sums added up, on the host (collective over every rank, on the gloo control group)."""
        parts = {name: value * 0.0 if name in _REPLICATED and state.tp_rank != 0 else value
                 for name, value in self.tensors.items()}
        flat = torch.cat([value.flatten() for value in parts.values()]).cpu()
        dist.all_reduce(flat, group=state.control_group)
        sizes = [value.numel() for value in parts.values()]
        return {name: piece.view(value.shape) for (name, value), piece in zip(parts.items(), flat.split(sizes))}


@contextlib.contextmanager
def _recording(chunks, sums: _Sums, state):
    """Hooks that add every layer's statistics to ``sums`` while the forward passes run."""
    handles = []
    for chunk in chunks:
        model = unwrap(chunk)
        for layer in model.decoder.layers:
            index = layer.layer_number - 1  # global: pipeline stages and virtual chunks number from their offset
            norms = (layer.input_layernorm, layer.pre_mlp_layernorm)
            assert all(isinstance(norm, torch.nn.Module) and list(norm.parameters()) for norm in norms), (
                "the norms must be modules of their own: build the model with the local layer spec")
            handles.append(layer.register_forward_hook(functools.partial(_on_layer, sums, index), with_kwargs=True))
            handles.append(layer.self_attention.linear_proj.register_forward_pre_hook(
                functools.partial(_on_heads, sums, index, state.tp_rank, layer.config.kv_channels)))
            handles.append(layer.mlp.linear_fc2.register_forward_pre_hook(
                functools.partial(_on_ffn, sums, index, state.tp_rank)))
            for norm in norms:
                handles.append(norm.register_forward_hook(functools.partial(_on_norm, sums.tensors["hidden"][index])))
        if model.post_process:
            handles.append(model.decoder.final_layernorm.register_forward_hook(
                functools.partial(_on_norm, sums.tensors["final_hidden"])))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _on_layer(sums: _Sums, index: int, module, args, kwargs, output) -> None:
    before = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [s, b, h]
    after = output[0]
    sums.tensors["cosine"][index] += torch.nn.functional.cosine_similarity(before.double(), after.double(), dim=-1).sum()


def _on_heads(sums: _Sums, index: int, tp_rank: int, head_dim: int, module, args) -> None:
    context = args[0]  # [s, b, heads/tp x head_dim]: the attention output of this rank's heads, in head order
    norms = torch.linalg.vector_norm(context.double().unflatten(-1, (-1, head_dim)), dim=-1).sum(dim=(0, 1))
    start = tp_rank * norms.numel()
    sums.tensors["heads"][index, start:start + norms.numel()] += norms


def _on_ffn(sums: _Sums, index: int, tp_rank: int, module, args) -> None:
    activation = args[0]  # [s, b, ffn/tp]: this rank's contiguous slice of the MLP channels
    total = activation.abs().sum(dim=(0, 1), dtype=torch.float64)
    start = tp_rank * total.numel()
    sums.tensors["ffn"][index, start:start + total.numel()] += total


def _on_norm(target: torch.Tensor, module, args, output) -> None:
    target += output.abs().sum(dim=(0, 1), dtype=torch.float64)  # [s, b, h] -> [h]


def _loss_sum(chunks, microbatches: list[torch.Tensor], bar: tqdm.tqdm | None = None) -> torch.Tensor:
    """The summed LM loss of this replica's tokens on the last stage (a scalar, 0 on other stages); ``bar`` advances
    once a micro-batch and chunk."""
    seq_length, micro_batch_size = microbatches[0].shape[1], microbatches[0].shape[0]
    position_ids = torch.arange(seq_length, device=microbatches[0].device).unsqueeze(0)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        # Megatron's loss at position t is for labels[t]; the last position's label is a wrapped token it ignores below.
        output = model(tokens, position_ids, attention_mask=None, labels=torch.roll(tokens, -1, dims=1))
        if bar is not None:
            bar.update()
        return output, _keep_loss

    with eval_mode(chunks), torch.no_grad():
        outputs = run_schedule(chunks, forward_step, microbatches, seq_length=seq_length,
                               micro_batch_size=micro_batch_size, forward_only=True)
    return sum((entry["loss_sum"] for entry in outputs), torch.zeros((), dtype=torch.float64, device=platform.device()))


def _keep_loss(per_token: torch.Tensor):
    total = per_token[:, :-1].sum(dtype=torch.float64)  # [b, s]: the last position has no next token
    return total.float() * 0.0, {"loss_sum": total.detach()}


def _reduced_loss(local: torch.Tensor, state) -> float:
    """The loss summed over replicas (counted on the first TP rank of each last stage)."""
    total = (local if state.tp_rank == 0 else local * 0.0).reshape(1).cpu()
    dist.all_reduce(total, group=state.control_group)
    return float(total)


@contextlib.contextmanager
def _skipped(chunks, index: int):
    """Layer ``index`` (global) passes its input through; the stage that holds it patches it, the others run as is."""
    patched = [layer for chunk in chunks for layer in unwrap(chunk).decoder.layers if layer.layer_number - 1 == index]
    for layer in patched:
        layer.forward = _identity_layer
    try:
        yield
    finally:
        for layer in patched:
            del layer.forward


def _identity_layer(*args, **kwargs):
    # A TransformerLayer's output: (hidden states, context); Megatron's block passes both by keyword.
    return kwargs["hidden_states"], kwargs.get("context")

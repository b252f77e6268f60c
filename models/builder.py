"""Builds the Megatron-Core ``GPTModel`` chunks of this rank for an HF config.

One module per virtual-pipeline chunk; ``pre_process`` / ``post_process`` by stage, on the
:class:`~megatron_gkd.parallel.ParallelState` given (from :func:`megatron_gkd.parallel.initialize`). Each chunk
carries an :class:`HFModelInfo` as ``chunk.hf_model_info`` so that exporters know the HF config, the mapping, the
source directory and the parallel state the chunk was built on.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from megatron_gkd import parallel, platform
from megatron_gkd.models.registry import ArchitectureSpec, get_architecture
from megatron_gkd.planning.model import model_shape
from megatron_gkd.planning.splits import check_split

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HFModelInfo:
    """What a built model knows about its Hugging Face origin."""

    hf_config: dict
    architecture: ArchitectureSpec
    rules: tuple
    dtype: torch.dtype = torch.float32
    """The dtype the model was built with (``params_dtype``, every parameter's dtype); the HF dtype
    ``save_hf`` writes by default."""
    source: str | None = None
    """The HF checkpoint directory it was loaded from (tokenizer files are copied from there)."""
    parallel_state: object = None
    """The :class:`~megatron_gkd.parallel.ParallelState` it was built on: the mapping, the exporter, the weight-sync
    plan and the engines that receive the model take its groups and coordinates from here
    (:func:`parallel_state_of`), as Megatron-Core's modules keep the ``pg_collection`` they were given."""


@functools.cache
def transformer_engine_available() -> bool:
    """Whether Transformer Engine imports (it needs CUDA at import, so any failure means no)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or its CUDA checks failing on other hosts
        return False
    return True


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(module, "module") and not hasattr(module, "hf_model_info"):
        module = module.module
    return module


def parallel_state_of(module: torch.nn.Module):
    """The :class:`~megatron_gkd.parallel.ParallelState` that ``module`` (a chunk :func:`build_model` built, wrapped
    or not) was built on."""
    return unwrap(module).hf_model_info.parallel_state


def transformer_config(hf_config: dict, state, *, dtype: torch.dtype = torch.float32, **overrides):
    """The ``TransformerConfig`` for ``hf_config`` on the layout of ``state``.

    ``overrides`` replace any field (e.g. ``perform_initialization=False``, recompute settings).
    """
    arch = get_architecture(hf_config)
    fields = dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=platform.device().type == "cpu",
        # megatron-core 0.16.1 warns that its own default, "full", is deprecated; [] is the same (the whole layer).
        cuda_graph_scope=[],
    )
    fields.update(arch.transformer_config(hf_config))
    fields.update(state.config.transformer_config_kwargs())
    fields.update(overrides)
    _check_divisible(hf_config, state)
    config_class = arch.config_class
    if config_class is None:
        from megatron.core.transformer import TransformerConfig as config_class
    return config_class(**fields)


def _check_divisible(hf_config: dict, state) -> None:
    """The check the dry run and the trainer's start make (``planning.splits``), for every other builder: a
    layout that does not split the model fails here, before Megatron-Core asserts inside its layer builder."""
    sizes = state.config
    check_split(model_shape(hf_config), tensor_model_parallel_size=sizes.tensor_model_parallel_size,
                pipeline_model_parallel_size=sizes.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=sizes.virtual_pipeline_model_parallel_size,
                expert_model_parallel_size=sizes.expert_model_parallel_size)


def _mark_tensor_parallel_weights(model: torch.nn.Module) -> int:
    """Sets the tensor-parallel marks of split weights, which Megatron-Core 0.16.1 sets only inside the
    initialisation that ``perform_initialization=False`` skips (loading weights from HF skips it).

    Without them Megatron takes a split weight for a replica on every TP rank but the first: its
    gradient-norm (and clipping) counts rank 0's shard alone. Marks are those the initialisation would
    set: column-parallel and vocabulary-parallel weights split along dim 0 (a gated MLP's fused
    ``[gate; up]`` with stride 2), row-parallel along dim 1. Returns the number of weights marked.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    marked = 0
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        gated = name.endswith("linear_fc1") and getattr(getattr(module, "config", None), "gated_linear_unit", False)
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=2 if gated else 1)
            marked += 1
    return marked


DEFAULT_SEED = 1234


def _place_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Casts the floating-point parameters built in another dtype to ``dtype``, and moves the model to the
    platform's device.

    The local spec's torch norms ignore ``params_dtype`` and build float32 weights, while Transformer
    Engine's norms follow it and Megatron's training script casts the whole model (``Float16Module``).
    A bf16 model here is then bf16 throughout as on a GPU: the optimizer keeps the float32 main copy of
    every weight, weight sync sends bf16, and the norms run their fused kernel (mixed input and weight
    dtypes take a slow path). Buffers keep their dtype (DeepSeek-V3's float32 correction bias).

    Megatron's own layers allocate on the accelerator, but the local spec's torch norms are built on the
    host (Megatron's training script moves the whole model to the GPU): without the move a forward on a
    GPU failed in the first norm ("weight is on cpu").
    """
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    if platform.is_set_up():
        model.to(platform.device())


def _ensure_rng_tracker() -> None:
    """Seeds Megatron's model-parallel RNG tracker if nobody has (its forward needs the states).

    A trainer that seeds itself (``parallel.seed``) before building keeps its seed.
    """
    from megatron.core import tensor_parallel

    if not tensor_parallel.get_cuda_rng_tracker().get_states():
        logger.info("Megatron's RNG tracker is not seeded; seeding it with %d", DEFAULT_SEED)
        parallel.seed(DEFAULT_SEED)


def build_model(
    hf_config: dict,
    *,
    dtype: torch.dtype = torch.float32,
    state=None,
    source: str | None = None,
    use_transformer_engine: bool | None = None,
    **config_overrides,
) -> list[torch.nn.Module]:
    """This rank's ``GPTModel`` chunks for ``hf_config`` (randomly initialised unless told otherwise).

    Args:
        hf_config: the HF ``config.json`` as a dict.
        dtype: parameter dtype.
        state: the :class:`~megatron_gkd.parallel.ParallelState` to build on. Library code passes it; the default,
            the state :func:`megatron_gkd.parallel.initialize` built in this process, serves scripts and tests
            (the only library place that looks it up: ``tests/unit/test_code_habits.py``).
        source: HF directory the weights come from, remembered for export.
        use_transformer_engine: Transformer Engine layer specs; default: when TE imports.
        config_overrides: ``TransformerConfig`` fields to override.

    Raises:
        ValueError: unsupported architecture, or sizes that the layout cannot split.
    """
    from megatron.core.models.gpt import GPTModel

    state = state or parallel.get_state()
    _ensure_rng_tracker()
    arch = get_architecture(hf_config)
    use_te = transformer_engine_available() if use_transformer_engine is None else use_transformer_engine
    if use_te and not transformer_engine_available():
        raise ValueError(
            "use_transformer_engine=True but transformer_engine does not import here; install "
            "transformer-engine[pytorch] for your CUDA, or leave use_transformer_engine unset"
        )
    config = transformer_config(hf_config, state, dtype=dtype, **config_overrides)
    model_kwargs = arch.gpt_model_kwargs(hf_config)
    info = HFModelInfo(
        hf_config=hf_config, architecture=arch, rules=tuple(arch.weight_rules(hf_config)), dtype=dtype, source=source,
        parallel_state=state,
    )
    vpp = state.config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for chunk in range(vpp):
        vp_stage = chunk if vpp > 1 else None
        layer_spec = arch.layer_spec(
            config, use_transformer_engine=use_te, vp_stage=vp_stage, pp_rank=state.pp_rank
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            pre_process=state.is_first_stage(vp_stage),
            post_process=state.is_last_stage(vp_stage),
            vp_stage=vp_stage,
            **model_kwargs,
        )
        model.hf_model_info = info
        _place_parameters(model, dtype)
        if not config.perform_initialization:
            _mark_tensor_parallel_weights(model)
        chunks.append(model)
    logger.info(
        "built %s: %d chunk(s), transformer engine %s, %s",
        arch.name,
        len(chunks),
        "on" if use_te else "off",
        dtype,
    )
    return chunks

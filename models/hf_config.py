"""Reading a Hugging Face ``config.json`` as a plain dict, and the fields that moved between versions.

The dict is used as is (no ``transformers`` import): checkpoints on disk carry the keys of the
``transformers`` release that wrote them, so readers accept both spellings where they changed
(``rope_theta`` + ``rope_scaling`` before v5, ``rope_parameters`` from v5; ``num_experts`` vs
``num_local_experts``).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from megatron_gkd.planning.model import config_value, gqa_head_dim, read_config

# One reader of the config file and of the keys' spellings for both: the planner's, which has no torch import
# (dry runs plan on a laptop).
get = config_value
head_dim = gqa_head_dim


def read_hf_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` of the HF checkpoint directory ``path`` (or the file itself).

    Raises:
        FileNotFoundError: there is no ``config.json``.
    """
    return read_config(path)


def architecture_name(hf_config: dict) -> str:
    """``architectures[0]`` of the config, the key of the model registry."""
    names = hf_config.get("architectures") or []
    if not names:
        raise ValueError("the HF config has no 'architectures' entry; add e.g. \"architectures\": [\"LlamaForCausalLM\"]")
    return names[0]


@dataclasses.dataclass(frozen=True)
class RopeSettings:
    """Rotary embedding of a config: base and the scaling variant (``rope_type``)."""

    theta: float
    rope_type: str = "default"
    params: dict = dataclasses.field(default_factory=dict)


def rope_settings(hf_config: dict) -> RopeSettings:
    """The RoPE base and scaling of a config, from either the v4 or the v5 keys."""
    params = dict(hf_config.get("rope_parameters") or {})
    legacy = hf_config.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.pop("rope_theta", None) or hf_config.get("rope_theta") or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    return RopeSettings(theta=float(theta), rope_type=rope_type, params=params)


def torch_dtype(hf_config: dict, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype the checkpoint declares (``dtype`` in v5, ``torch_dtype`` before)."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else default

"""YAML presets + dotted command-line overrides -> one validated :class:`GKDConfig` (OmegaConf merges).

The dataclasses are the schema: ``OmegaConf.structured(GKDConfig)`` gives every key its type and
default, each layer (preset files, then overrides) is merged onto it, and ``OmegaConf.to_object`` builds
the dataclasses, whose ``__post_init__`` checks run. A preset may start from others with a top-level
``base: other.yaml`` (or a list; paths relative to the file). Unknown keys and values of the wrong type
fail with the full key, where it came from and the closest valid key.
"""

from __future__ import annotations

import os
import pathlib
from typing import Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as omegaconf_errors

from megatron_gkd.config.schema import GKDConfig
from megatron_gkd.registry import closest

BASE_KEY = "base"


def _valid_keys(node, path: str) -> list[str]:
    """Keys under dotted ``path`` of the schema, as full dotted keys."""
    parts = [part for part in path.split(".") if part]
    node_config = OmegaConf.structured(GKDConfig)
    for part in parts:
        if not isinstance(node_config, DictConfig) or part not in node_config:
            return []
        node_config = node_config[part]
    if not isinstance(node_config, DictConfig):
        return []
    prefix = ".".join(parts)
    return [f"{prefix}.{key}" if prefix else key for key in node_config.keys()]


def _translate(error: Exception, source: str) -> ValueError:
    """An OmegaConf error as a ValueError naming the key, the source and the fix."""
    full_key = getattr(error, "full_key", None) or ""
    if isinstance(error, omegaconf_errors.ConfigKeyError) and full_key:
        parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
        hint = closest(full_key, _valid_keys(None, parent))
        return ValueError(f"unknown config key {full_key!r} ({source}){hint}")
    message = getattr(error, "msg", None) or str(error).splitlines()[0]
    where = f"config key {full_key!r}" if full_key else "config"
    return ValueError(f"{where} ({source}): {message}")


def _load_yaml(path: pathlib.Path, seen: tuple[pathlib.Path, ...] = ()) -> list[tuple[DictConfig, str]]:
    """The layers of ``path``: its bases first (recursively), then itself."""
    path = path.resolve()
    if path in seen:
        raise ValueError(f"config {path} includes itself through '{BASE_KEY}:' ({' -> '.join(map(str, seen))})")
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    layer = OmegaConf.load(path)
    if not isinstance(layer, DictConfig):
        raise ValueError(f"config file {path} must hold a mapping of sections (parallel:, student:, ...)")
    layers: list[tuple[DictConfig, str]] = []
    bases = layer.pop(BASE_KEY, None)
    for base in [bases] if isinstance(bases, str) else list(bases or []):
        layers += _load_yaml(path.parent / str(base), seen + (path,))
    return layers + [(layer, f"from {os.path.relpath(path)}")]


def merge_layers(config_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """The merged (not yet instantiated) configuration tree.

    Raises:
        ValueError: a file is missing or malformed, an override is not ``key=value``, a key is unknown
            or a value has the wrong type.
    """
    merged = OmegaConf.structured(GKDConfig)
    layers = _load_yaml(pathlib.Path(config_path)) if config_path else []
    for override in overrides:
        if "=" not in override or override.startswith("="):
            raise ValueError(f"override {override!r} must look like section.key=value (e.g. rollout.n=8)")
    if overrides:
        layers.append((OmegaConf.from_dotlist(list(overrides)), "command line"))
    for layer, source in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except omegaconf_errors.OmegaConfBaseException as error:
            raise _translate(error, source) from None
    return merged


def load_config(config_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> GKDConfig:
    """The validated configuration of a run: the schema's defaults, the preset file (and its bases),
    then ``overrides`` (``["loss.type=tcad", "rollout.n=8"]``).

    Raises:
        ValueError: naming the key and the fix (unknown key, wrong type, invalid or inconsistent value).
    """
    merged = merge_layers(config_path, overrides)
    try:
        return OmegaConf.to_object(merged)
    except omegaconf_errors.OmegaConfBaseException as error:
        raise _translate(error, "resolved config") from None


def to_yaml(config: GKDConfig) -> str:
    """The resolved configuration as YAML (what ``config.yaml`` of a run and ``--print-config`` hold)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_dict(config: GKDConfig) -> dict:
    """The resolved configuration as plain data (JSON/msgpack-able)."""
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)


def replace(config: GKDConfig, overrides: Sequence[str]) -> GKDConfig:
    """``config`` with dotted ``overrides`` applied (and every check run again)."""
    merged = OmegaConf.merge(OmegaConf.structured(config), OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_object(merged)


__all__ = ["load_config", "merge_layers", "replace", "to_dict", "to_yaml"]

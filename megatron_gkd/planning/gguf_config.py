"""GGUF files (llama.cpp's one-file checkpoints) where an HF checkpoint is expected: which paths name one, and the HF
``config.json`` dict its metadata describes.

A path names a GGUF when it is a file that starts with the GGUF magic, or a directory without ``config.json`` that
holds exactly one ``*.gguf``. Reading the config parses the file's metadata through ``transformers`` (the code its
weights are later converted with, so both agree) without touching the tensors; unlike the rest of the planner it
imports ``transformers`` and torch, and only for a GGUF. The weights are converted by :mod:`megatron_gkd.models.gguf`.
"""

from __future__ import annotations

import os
import re

GGUF_MAGIC = b"GGUF"
INSTALL_HINT = "pip install 'megatron-gkd[gguf]' (or: pip install gguf accelerate)"
# llama.cpp's split files ("model-00001-of-00003.gguf"), which transformers reads one at a time only.
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def gguf_file(path: str | os.PathLike) -> str | None:
    """The GGUF file ``path`` names (the file, or the one ``*.gguf`` of a directory), else None.

    None also for a path that does not exist or is no local path (a Hub id): its reader reports that.

    Raises:
        ValueError: a ``.gguf`` file without the GGUF magic, a directory with several ``*.gguf`` files, or a split
            GGUF, each with the fix.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return None
        found = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        if len(found) > 1:
            raise ValueError(f"{path} holds several GGUF files ({', '.join(found)}); point at one of them")
        if not found:
            return None
        path = os.path.join(path, found[0])
    elif not os.path.isfile(path):
        return None
    with open(path, "rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        if path.endswith(".gguf"):
            raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}): a partial "
                             "download? Fetch it again")
        return None
    if _SPLIT.search(path):
        raise ValueError(f"{path} is one part of a split GGUF; merge the parts into one file first "
                         "(llama.cpp: llama-gguf-split --merge FIRST_PART OUT.gguf)")
    return path


def require_gguf() -> None:
    """Raises an ImportError that says what to install when ``gguf`` or ``accelerate`` is missing: ``transformers``
    needs both to read a GGUF (``accelerate`` for the weights)."""
    missing = []
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ImportError(f"reading a GGUF checkpoint needs {' and '.join(missing)}: {INSTALL_HINT}")


def read_gguf_config(file: str | os.PathLike) -> dict:
    """The HF ``config.json`` dict of a GGUF file: what its conversion writes, minus the weights' ``dtype``.

    ``architectures`` is the causal-LM class ``transformers`` loads the file with (``LlamaForCausalLM``); the GGUF
    quantization marker is dropped (the converted checkpoint holds plain floats).
    """
    require_gguf()
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    directory, name = os.path.split(os.path.abspath(os.fspath(file)))
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    hf = config.to_dict()
    hf.pop("quantization_config", None)
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if not hf.get("architectures") and architecture is not None:
        hf["architectures"] = [architecture]
    return hf

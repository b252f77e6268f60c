"""A GGUF student through ``load_hf`` at TP=2: the Megatron model gives the logits of the HF model the GGUF was written
from, and ``save_hf`` writes that model back with the GGUF's tokenizer and chat template. Both ranks resolving the file
at once convert it once; the weights are converted by rank 1 (transformers' ``save_pretrained`` writes on rank 0 only
once torch.distributed is initialised, which the conversion must not depend on).

The file is a tiny Llama with tied embeddings stored as Q4_1, SmolLM2's layout and type
(``megatron_gkd.testing.gguf_models``).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from megatron_gkd.models import checkpoints
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.gguf_models import make_tiny_gguf, tokens
from megatron_gkd.testing.hf_models import hf_logits, megatron_logits, read_safetensors_dir

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4  # as the HF parity tests: float32 through two stacks


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load_forward_save(gguf: str, tokens: torch.Tensor, out: str):
    """Rank body: the conversion log of this rank, the full logits (last stage) and a save_hf directory."""
    import torch.distributed as dist

    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf, resolve_checkpoint, save_hf

    log = _Messages()
    logger = logging.getLogger(checkpoints.__name__)
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    state = parallel.initialize(tensor_model_parallel_size=2)
    resolve_checkpoint(gguf)  # both ranks at once: the tokenizer entry
    if state.rank == 1:
        resolve_checkpoint(gguf, dtype=torch.float32)
    dist.barrier()
    chunks = load_hf(gguf, dtype=torch.float32)  # both find rank 1's conversion
    logits = megatron_logits(chunks, tokens)
    save_hf(chunks, out)
    parallel.destroy()
    return log.messages, logits


def test_both_ranks_load_one_conversion_with_the_logits_of_the_source_model(tmp_path):
    tiny = make_tiny_gguf(tmp_path / "model", tensor_type="Q4_1", tied=True)
    ids = torch.randint(0, len(tokens()), (2, 16), generator=torch.Generator().manual_seed(3))
    out = str(tmp_path / "saved")
    results = run_distributed(_load_forward_save, 2, args=(str(tiny.gguf), ids, out), timeout=600,
                              env={checkpoints.CACHE_ENV: str(tmp_path / "cache")})

    conversions = [[message for message in messages if message.startswith("converting GGUF")] for messages, _ in results]
    assert sum(message.endswith("(tokenizer)") for rank in conversions for message in rank) == 1, conversions
    assert [sum(message.endswith("(float32)") for message in rank) for rank in conversions] == [0, 1], conversions
    reference = hf_logits(tiny.reference, ids)
    for rank, (_, logits) in enumerate(results):
        error = (logits - reference).abs().max().item()
        assert error < TOLERANCE, f"rank {rank}: max |logit error| {error:.2e}"

    saved, original = read_safetensors_dir(out), read_safetensors_dir(tiny.reference)
    assert sorted(saved) == sorted(original)
    assert all(torch.equal(saved[name], tensor) for name, tensor in original.items())
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert os.path.isfile(os.path.join(out, name)), f"{name} not carried over from the GGUF"

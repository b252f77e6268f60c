"""A GGUF file wherever an HF checkpoint is accepted: dequantized into a cached HF directory that holds exactly the
weights, logits, tokenizer and chat template of the model it was written from.

The GGUF files are written on the fly (``megatron_gkd.testing.gguf_models``): nothing is downloaded. The Megatron
student loader is checked at TP=2 in ``tests/distributed/models/test_gguf_load.py`` (with both ranks converting at
once); the real SmolLM2 in
``tests/unit/recipes/test_smollm2.py`` (slow).
"""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest
import torch

from megatron_gkd.data.tokenization import load_tokenizer
from megatron_gkd.models import checkpoints, convert, resolve_checkpoint
from megatron_gkd.planning import model_shape, read_config
from megatron_gkd.teacher import ScoreBatch, SequenceRequest
from megatron_gkd.teacher.backends import build_backend
from megatron_gkd.teacher.cache.store import checkpoint_digest
from megatron_gkd.testing.gguf_models import BOS_ID, DEFAULT_SYSTEM_PROMPT, EOS_ID, SPECIAL_TOKENS, make_tiny_gguf, tokens
from megatron_gkd.testing.hf_models import hf_logits, read_safetensors_dir

CASES = {"F32-tied": ("F32", True), "F16-untied": ("F16", False), "Q8_0-tied": ("Q8_0", True)}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test converts into its own cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv(checkpoints.CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    tensor_type, tied = CASES[request.param]
    return make_tiny_gguf(tmp_path_factory.mktemp(request.param), tensor_type=tensor_type, tied=tied)


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("f32"))


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, len(tokens()), (2, 12), generator=torch.Generator().manual_seed(seed))


def test_gguf_resolves_to_the_weights_and_logits_of_its_model(tiny, cache):
    path = resolve_checkpoint(tiny.gguf, dtype="float32")
    assert str(cache) in path
    converted, reference = read_safetensors_dir(path), read_safetensors_dir(tiny.reference)
    assert sorted(converted) == sorted(reference)
    for name, tensor in reference.items():
        assert converted[name].dtype == torch.float32 and torch.equal(converted[name], tensor), name
    assert torch.equal(hf_logits(path, _tokens()), hf_logits(tiny.reference, _tokens()))
    config, expected = read_config(path), read_config(tiny.reference)
    for key in ("architectures", "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "tie_word_embeddings", "rms_norm_eps", "rope_parameters", "max_position_embeddings"):
        assert config[key] == expected[key], key
    assert "quantization_config" not in config


def test_a_directory_holding_one_gguf_is_that_file(tiny_f32):
    assert resolve_checkpoint(tiny_f32.gguf.parent, dtype="float32") == resolve_checkpoint(tiny_f32.gguf, dtype="float32")


def test_the_tokenizer_keeps_its_chat_template_and_special_tokens(tiny_f32):
    path = resolve_checkpoint(tiny_f32.gguf)  # no dtype: config and tokenizer only
    assert not any(name.endswith(".safetensors") for name in os.listdir(path))
    tokenizer = load_tokenizer(str(tiny_f32.gguf))
    assert len(tokenizer) == len(tokens())
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "the thin"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == (f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nthe thin<|im_end|>\n"
                        "<|im_start|>assistant\n")
    reference = load_tokenizer(str(tiny_f32.reference))
    for text in (rendered, " the thin man", "ana in\nthe é ☃"):
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    for index, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.encode(token, add_special_tokens=False) == [index]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)


def test_a_second_resolve_reuses_the_conversion_and_an_edited_file_does_not(tmp_path, monkeypatch):
    tiny = make_tiny_gguf(tmp_path / "model")
    first = resolve_checkpoint(tiny.gguf, dtype="float32")

    def refuse(*args, **kwargs):
        raise AssertionError("converted again")

    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "convert_gguf", refuse)
        patch.setattr(checkpoints, "_HASHES", {})  # as another process: nothing remembered but the cache
        assert resolve_checkpoint(tiny.gguf, dtype="float32") == first
    half = resolve_checkpoint(tiny.gguf, dtype=torch.bfloat16)
    assert half != first and all(t.dtype == torch.bfloat16 for t in read_safetensors_dir(half).values())
    edited = make_tiny_gguf(tmp_path / "model", seed=1)  # the same path, other weights
    second = resolve_checkpoint(edited.gguf, dtype="float32")
    assert second != first
    assert torch.equal(read_safetensors_dir(second)["model.norm.weight"], read_safetensors_dir(edited.reference)["model.norm.weight"])
    assert sorted(os.listdir(first)) == sorted(os.listdir(second))  # no partial directory left behind
    assert not [name for name in os.listdir(os.path.dirname(first)) if ".partial" in name]


def test_hf_directories_and_other_paths_pass_through(tiny_f32, tmp_path):
    assert resolve_checkpoint(tiny_f32.reference, dtype="float32") == str(tiny_f32.reference)
    assert resolve_checkpoint("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a Hub id, for the tools that take one
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(tiny_f32.gguf.read_bytes())
    with pytest.raises(ValueError, match="a.gguf, b.gguf"):
        resolve_checkpoint(two, dtype="float32")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_checkpoint(fake, dtype="float32")
    with pytest.raises(ValueError, match="dtype"):
        resolve_checkpoint(tiny_f32.gguf, dtype="int8")


def test_a_missing_gguf_package_says_what_to_install(tiny_f32, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ImportError, match=r"megatron-gkd\[gguf\]"):
        resolve_checkpoint(tiny_f32.gguf, dtype="float32")


def test_the_planner_reads_a_gguf_config_without_converting(tiny_f32, cache):
    config = read_config(tiny_f32.gguf)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == len(tokens())
    assert model_shape(config) == model_shape(read_config(tiny_f32.reference))
    assert not cache.exists()


def test_the_teacher_hf_backend_serves_the_gguf(tiny_f32):
    ids = np.array([5, 40, 70, 90, 120, 7, 8, 9], dtype=np.int64)
    batch = ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=3)], top_k=4)
    served, reference = build_backend("hf", model=str(tiny_f32.gguf)), build_backend("hf", model=str(tiny_f32.reference))
    assert served.info().tokenizer_size == len(tokens())
    got, want = served.score(batch)[0], reference.score(batch)[0]
    assert np.array_equal(got.topk_ids, want.topk_ids) and np.array_equal(got.token_logprobs, want.token_logprobs)


def test_a_teacher_cache_binds_to_the_gguf_files_bytes(tiny_f32, tmp_path):
    digest = checkpoint_digest(tiny_f32.gguf)
    assert checkpoint_digest(tiny_f32.gguf.parent) == digest  # the directory holding it names the same file
    copy = tmp_path / "elsewhere" / tiny_f32.gguf.name
    copy.parent.mkdir()
    shutil.copyfile(tiny_f32.gguf, copy)
    assert checkpoint_digest(copy) == digest
    assert checkpoint_digest(make_tiny_gguf(tmp_path / "other", seed=1).gguf) != digest


def test_the_conversion_command_writes_an_hf_directory(tiny_f32, tmp_path):
    out = tmp_path / "hf"
    convert.main(["gguf-to-hf", "--gguf", str(tiny_f32.gguf), "--out", str(out), "--dtype", "float32"])
    converted = read_safetensors_dir(out)
    assert all(torch.equal(converted[name], t) for name, t in read_safetensors_dir(tiny_f32.reference).items())
    assert (out / "chat_template.jinja").is_file()
    with pytest.raises(FileExistsError):
        convert.main(["gguf-to-hf", "--gguf", str(tiny_f32.gguf), "--out", str(out)])

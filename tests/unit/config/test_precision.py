"""Precision in the config: ``student.dtype`` (Megatron's mixed precision when bf16/fp16), what the rollout
engine serves (``rollout.dtype``, default the student's) and what HF exports hold (``checkpoint.hf_dtype``,
default the student's). GPU presets train in bf16, the CPU presets in float32."""

import pathlib

import pytest
from transformers import PreTrainedTokenizerFast

from megatron_gkd.config import load_config
from megatron_gkd.trainer.components import rollout_engine_kwargs

ROOT = pathlib.Path(__file__).resolve().parents[3]
BASE = ROOT / "configs" / "cpu_tiny.yaml"
CHOICES = "choose one of ['float32', 'bfloat16', 'float16']"


@pytest.mark.parametrize("override, message", [
    ("student.dtype=bf16", f"student.dtype='bf16'; {CHOICES} (write 'bfloat16')"),
    ("student.dtype=float64", f"student.dtype='float64'; {CHOICES}"),
    ("rollout.dtype=fp32", f"rollout.dtype='fp32'; {CHOICES} or null (write 'float32')"),
    ("checkpoint.hf_dtype=half", f"checkpoint.hf_dtype='half'; {CHOICES} or null (write 'float16')"),
])
def test_a_bad_dtype_names_the_key_and_the_spelling_to_use(override, message):
    with pytest.raises(ValueError) as error:
        load_config(BASE, [override])
    assert message in str(error.value)


@pytest.mark.parametrize("overrides", [["student.dtype=bfloat16"], ["rollout.dtype=bfloat16"],
                                       ["student.dtype=bfloat16", "rollout.dtype=float32"]])
def test_verify_in_bf16_needs_a_tolerance_above_the_bf16_noise(overrides):
    """vLLM and Megatron differ by up to 0.08 in bf16 with the same weights: the float32 default (1e-4)
    would fail every sync."""
    with pytest.raises(ValueError, match="set weight_sync.verify_tolerance=0.25"):
        load_config(BASE, overrides + ["weight_sync.verify=true"])
    load_config(BASE, overrides + ["weight_sync.verify=true", "weight_sync.verify_tolerance=0.25"])
    load_config(BASE, ["weight_sync.verify=true"])  # float32 keeps the tight default


@pytest.mark.parametrize("preset, dtype", [("qwen3_dense", "bfloat16"), ("qwen3_moe", "bfloat16"),
                                           ("deepseek_v3_671b", "bfloat16"), ("cpu_tiny", "float32"),
                                           ("demo_cpu", "float32")])
def test_gpu_presets_train_in_bf16_and_cpu_presets_in_float32(preset, dtype):
    config = load_config(ROOT / "configs" / f"{preset}.yaml")
    assert config.student.dtype == dtype
    assert config.rollout.dtype is None and config.checkpoint.hf_dtype is None  # both follow the student


def test_the_rollout_engine_serves_the_student_dtype_unless_told_otherwise():
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_word_level(), eos_token="</s>", pad_token="<unk>")
    bf16 = load_config(BASE, ["student.dtype=bfloat16"])
    assert rollout_engine_kwargs(bf16, tokenizer)["dtype"] == "bfloat16"
    served_fp32 = load_config(BASE, ["student.dtype=bfloat16", "rollout.dtype=float32"])
    assert rollout_engine_kwargs(served_fp32, tokenizer)["dtype"] == "float32"


def _word_level():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))

"""The cut applied to HF tensors gives the model cut by hand, and the checkpoint written loads in transformers.

The teacher's tensors are read from its safetensors files (what the exporter yields at TP=1), cut by
:class:`TensorPruner` at random kept indices, written with ``write_hf`` and loaded with ``transformers``; its logits
must equal those of the same model cut module by module (``megatron_gkd.testing.pruning.prune_by_hand``).
"""

import json
import os

import pytest
import torch

from megatron_gkd.models import read_hf_config, write_hf
from megatron_gkd.prune import KeptIndices, ModelSizes, PruneTargets, TensorPruner, pruned_hf_config, pruned_tensors
from megatron_gkd.testing.hf_models import hf_logits, make_tiny_checkpoint, read_safetensors_dir
from megatron_gkd.testing.pruning import make_gqa_checkpoint, prune_by_hand

CASES = {
    # SmolLM2's attention: 9 heads over 3 groups, tied embeddings. Heads inside the groups, then whole groups.
    "gqa-heads": ("gqa", PruneTargets(num_layers=3, hidden_size=96, ffn_hidden_size=50, num_attention_heads=6)),
    "gqa-groups": ("gqa", PruneTargets(num_query_groups=2, hidden_size=0.5)),
    # q/k/v biases and a tied head.
    "qwen2": ("Qwen2ForCausalLM", PruneTargets(num_layers=2, hidden_size=64, ffn_hidden_size=100, num_attention_heads=2)),
    # q/k norms over head_dim, an untied head, head_dim != hidden / heads.
    "qwen3": ("Qwen3ForCausalLM", PruneTargets(num_layers=3, hidden_size=48, num_query_groups=1)),
}


def _random_kept(teacher: ModelSizes, student: ModelSizes, seed: int) -> KeptIndices:
    generator = torch.Generator().manual_seed(seed)

    def pick(total, count):
        return sorted(torch.randperm(total, generator=generator)[:count].tolist())

    layers = pick(teacher.num_layers, student.num_layers)
    groups = [pick(teacher.num_query_groups, student.num_query_groups) for _ in layers]
    heads = [[group * teacher.heads_per_group + head for group in kept
              for head in pick(teacher.heads_per_group, student.heads_per_group)] for kept in groups]
    return KeptIndices(layers=layers, hidden=pick(teacher.hidden_size, student.hidden_size), query_groups=groups,
                       heads=heads, ffn=[pick(teacher.ffn_hidden_size, student.ffn_hidden_size) for _ in layers])


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {
        "gqa": make_gqa_checkpoint(root / "gqa"),
        "Qwen2ForCausalLM": make_tiny_checkpoint("Qwen2ForCausalLM", root / "qwen2", seed=1),
        "Qwen3ForCausalLM": make_tiny_checkpoint("Qwen3ForCausalLM", root / "qwen3", seed=2),
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_pruned_checkpoint_equals_the_model_pruned_by_hand(case, teachers, tmp_path):
    name, targets = CASES[case]
    path = teachers[name]
    hf_config = read_hf_config(path)
    teacher = ModelSizes.of(hf_config)
    student = targets.resolve(teacher)
    kept = _random_kept(teacher, student, seed=len(case))
    tensors = read_safetensors_dir(path).items()
    write_hf(pruned_tensors(iter(tensors), TensorPruner(kept, teacher)), tmp_path, dtype=torch.float32,
             hf_config=pruned_hf_config(hf_config, student, kept.layers))

    written = read_safetensors_dir(tmp_path)
    assert len({name.split(".")[2] for name in written if name.startswith("model.layers.")}) == student.num_layers
    tied = hf_config.get("tie_word_embeddings", False)
    assert ("lm_head.weight" in written) == (not tied)
    tokens = torch.randint(0, hf_config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = prune_by_hand(path, kept)(input_ids=tokens).logits
    torch.testing.assert_close(hf_logits(tmp_path, tokens), expected, rtol=0, atol=1e-5)


def test_a_tied_student_stays_tied_and_the_odd_gqa_shape_is_valid(teachers, tmp_path):
    from transformers import AutoModelForCausalLM

    path = teachers["gqa"]
    hf_config = read_hf_config(path)
    teacher = ModelSizes.of(hf_config)
    student = PruneTargets(num_attention_heads=3, hidden_size=0.5).resolve(teacher)
    kept = _random_kept(teacher, student, seed=0)
    write_hf(pruned_tensors(iter(read_safetensors_dir(path).items()), TensorPruner(kept, teacher)), tmp_path,
             dtype=torch.float32, hf_config=pruned_hf_config(hf_config, student, kept.layers))
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (3, 3, 16)
    assert config["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(os.fspath(tmp_path))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (3 * 16, 72)


def test_an_unknown_tensor_is_refused_not_copied():
    teacher = ModelSizes(num_layers=1, hidden_size=4, ffn_hidden_size=4, num_attention_heads=2, num_query_groups=1,
                         kv_channels=2)
    kept = KeptIndices(layers=[0], hidden=[0, 1], query_groups=[[0]], heads=[[0]], ffn=[[0]])
    pruner = TensorPruner(kept, teacher)
    assert pruner("model.layers.0.mlp.up_proj.weight", torch.ones(4, 4)) [1].shape == (1, 2)
    with pytest.raises(ValueError, match="cannot prune HF tensor 'model.layers.0.mlp.experts.0.up_proj.weight'"):
        pruner("model.layers.0.mlp.experts.0.up_proj.weight", torch.ones(4, 4))
    assert pruner("model.layers.1.mlp.up_proj.weight", torch.ones(4, 4)) is None  # a dropped layer

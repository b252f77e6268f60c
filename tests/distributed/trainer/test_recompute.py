"""``student.recompute`` trades memory for compute and nothing else: a real Megatron student at TP=2 gives the same
loss and gradients with no recomputation, Megatron's selective recomputation (core attention) and full recomputation
(every layer), the options :class:`~megatron_gkd.config.schema.Recompute` hands Megatron."""

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

VOCAB = 256


def _gradients(path: str) -> dict:
    from megatron_gkd import parallel
    from megatron_gkd.config.schema import Recompute
    from megatron_gkd.models import load_hf

    state = parallel.initialize(tensor_model_parallel_size=2)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=generator)
    positions = torch.arange(12).expand(2, -1)
    weights = torch.randn(2, 12, VOCAB // 2, generator=generator)  # this rank's vocabulary shard
    results = {}
    for choice in Recompute:
        parallel.seed(0)
        [chunk] = load_hf(path, state=state, **choice.megatron_options)
        chunk.train()
        layer = chunk.decoder.layers[0]
        calls = {"mlp": 0, "core_attention": 0}  # forwards of each, the backward's recomputation included
        layer.mlp.register_forward_hook(lambda *_: calls.__setitem__("mlp", calls["mlp"] + 1))
        layer.self_attention.core_attention.register_forward_hook(
            lambda *_: calls.__setitem__("core_attention", calls["core_attention"] + 1))
        logits = chunk(tokens, positions, attention_mask=None)  # [b, s, V/tp]
        loss = (logits * weights).sum()
        loss.backward()
        results[choice.value] = {"loss": loss.item(), "calls": calls,
                                 "grads": {n: p.grad.clone() for n, p in chunk.named_parameters()}}
    return results


def test_recompute_changes_no_gradient(tmp_path):
    from megatron_gkd.recipes.tiny import build_checkpoint

    path = str(build_checkpoint(tmp_path / "student", vocab_size=VOCAB, hidden_size=128, num_layers=2, num_heads=4,
                                num_kv_heads=2))
    for rank in run_distributed(_gradients, 2, args=(path,)):
        # What each choice recomputes: nothing, the core attention, the whole layer.
        assert rank["none"]["calls"] == {"mlp": 1, "core_attention": 1}
        assert rank["selective"]["calls"] == {"mlp": 1, "core_attention": 2}
        assert rank["full"]["calls"] == {"mlp": 2, "core_attention": 2}
        reference = rank["none"]
        for choice in ("selective", "full"):
            assert rank[choice]["loss"] == reference["loss"]
            assert rank[choice]["grads"].keys() == reference["grads"].keys()
            for name, grad in rank[choice]["grads"].items():
                torch.testing.assert_close(grad, reference["grads"][name], rtol=0, atol=0, msg=f"{choice}: {name}")


def test_recompute_names_its_choices():
    from megatron_gkd.config.schema import StudentConfig

    assert StudentConfig(recompute="selective").recompute.megatron_options == {"recompute_granularity": "selective"}
    assert StudentConfig().recompute.megatron_options == {}
    with pytest.raises(ValueError, match=r"student.recompute='True': choose one of \['none', 'selective', 'full'\] "
                                         r"\(true was the old spelling of full\)"):
        StudentConfig(recompute="True")

"""The word embedding of a DDP-wrapped student adds its gradient into ``main_grad`` row by row
(``models.embedding_grad``): the same gradient as ``F.embedding``'s dense backward, untied and tied, at TP=1 and TP=2
(each rank's rows of the vocabulary), and no dense ``[V/tp, h]`` gradient of the embedding is ever built."""

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _grads(tp: int, tied: bool):
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import layers

    from megatron_gkd import parallel
    from megatron_gkd.models import embedding_grad, unwrap
    from megatron_gkd.testing import mcore

    state = parallel.initialize(tensor_model_parallel_size=tp)
    try:
        spec = mcore.TinyGPTSpec(tie_embeddings=tied, num_layers=2)
        [chunk] = mcore.build_model_chunks(spec, state)  # DDP-wrapped: installs the embedding's backward
        weight = unwrap(chunk).embedding.word_embeddings.weight
        tokens = mcore.synthetic_batches(spec, 1)[0][0]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
        results = {}
        for name, functional in (("rows", embedding_grad.FUNCTIONAL_VIEW), ("dense", F)):
            layers.F = functional
            dense_grads = []  # every gradient autograd hands the weight (the lookup's, and the tied output layer's)
            handle = weight.register_hook(lambda grad: None if grad is None else dense_grads.append(tuple(grad.shape)))
            chunk.zero_grad_buffer()
            chunk(inputs, positions, attention_mask=None, labels=labels).float().mean().backward()
            chunk.finish_grad_sync()
            handle.remove()
            results[name] = (weight.main_grad.clone(), dense_grads)
        layers.F = embedding_grad.FUNCTIONAL_VIEW
        return results
    finally:
        parallel.destroy()


@pytest.mark.parametrize("tp, tied", [(1, False), (1, True), (2, False)], ids=["tp1", "tp1-tied", "tp2"])
def test_the_embedding_adds_its_rows_into_main_grad(tp, tied):
    for rank in run_distributed(_grads, tp, args=(tp, tied)):
        rows, rows_dense = rank["rows"]
        dense, dense_dense = rank["dense"]
        assert dense.abs().sum() > 0
        torch.testing.assert_close(rows, dense, rtol=1e-6, atol=1e-9)
        # F.embedding's backward hands the weight a dense gradient (once more for the tied output layer's); the rows
        # never do: only the tied output layer's remains.
        assert len(dense_dense) == 1 and len(rows_dense) == (1 if tied else 0), (dense_dense, rows_dense)

"""The library's forward-only call restores each chunk's train/eval mode (weight-sync ``verify`` used to
leave a training student in eval mode) and gives the same logits in either mode."""

import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _modes_after_verify_forward():
    from megatron_gkd import parallel
    from megatron_gkd.testing import mcore
    from megatron_gkd.weight_sync import student_prompt_logprobs

    state = parallel.initialize(tensor_model_parallel_size=2)
    chunks = mcore.build_model_chunks(mcore.TinyGPTSpec(num_layers=2), state)
    prompts = [[1, 5, 9, 14], [3, 7]]
    for chunk in chunks:
        chunk.train()
    from_training = student_prompt_logprobs(chunks, prompts)
    still_training = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    from_eval = student_prompt_logprobs(chunks, prompts)
    still_eval = [not chunk.training for chunk in chunks]
    parallel.destroy()
    return still_training, still_eval, from_training, from_eval


def test_forward_restores_train_and_eval_modes():
    for still_training, still_eval, from_training, from_eval in run_distributed(_modes_after_verify_forward, 2):
        assert all(still_training) and all(still_eval)
        assert from_training.shape == (4,)
        torch.testing.assert_close(from_training, from_eval, rtol=0, atol=0)

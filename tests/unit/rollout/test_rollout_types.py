"""SamplingConfig validation and conversion, RolloutBatch padding, prompt-length checks, the registry."""

import pytest
import torch

from megatron_gkd.rollout import RolloutBatch, SamplingConfig, build_engine, check_prompt_lengths, registered_engines


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.1, "sampling.temperature"),
    ("top_p", 0.0, "sampling.top_p"),
    ("top_p", 1.5, "sampling.top_p"),
    ("top_k", -2, "sampling.top_k"),
    ("max_tokens", 0, "sampling.max_tokens"),
    ("n", 0, "sampling.n"),
    ("logprobs_k", -1, "sampling.logprobs_k"),
    ("stop_token_ids", (3, -1), "sampling.stop_token_ids"),
])
def test_sampling_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**{field: value})


def test_sampling_config_to_vllm():
    config = SamplingConfig(temperature=0.7, top_p=0.9, top_k=-1, max_tokens=5, n=3, stop_token_ids=[7],
                            seed=10, logprobs_k=4)
    assert config.top_k == 0 and config.stop_token_ids == (7,)
    params = config.to_vllm(prompt_index=2)
    assert (params.n, params.temperature, params.top_p, params.max_tokens) == (3, 0.7, 0.9, 5)
    assert params.stop_token_ids == [7] and params.logprobs == 4 and params.seed == 16
    assert SamplingConfig(seed=None).to_vllm(5).seed is None


def test_rollout_batch_pads_and_reads_back():
    batch = RolloutBatch.from_samples(
        prompts=[[1, 2, 3], [1, 2, 3], [4]], responses=[[5], [6, 7], [8, 9, 10]],
        logprobs=[[-0.5], [-1.0, -2.0], [-0.1, -0.2, -0.3]], group_ids=[0, 0, 1],
        finish_reasons=["stop", "length", "length"], weight_version=3,
        topk=[[[5, 6]], [[6, 1], [7, 2]], [[8, 0], [9, 1], [10, 2]]], pad_token_id=0)
    assert batch.prompt_ids.shape == (3, 3) and batch.response_ids.shape == (3, 3)
    assert batch.prompt_lengths.tolist() == [3, 3, 1] and batch.response_lengths.tolist() == [1, 2, 3]
    assert batch.prompt(2) == [4] and batch.response(1) == [6, 7]
    assert torch.equal(batch.logprobs(1), torch.tensor([-1.0, -2.0]))
    assert batch.topk(0).tolist() == [[5, 6]] and (batch.topk_ids[0, 1:] == -1).all()
    assert batch.num_generated_tokens == 6 and batch.weight_version == 3
    assert batch.rollout_logprobs[0, 1:].eq(0).all() and not batch.response_mask[0, 1:].any()


def test_prompt_length_check_counts_and_names_the_settings():
    check_prompt_lengths([[1] * 12], SamplingConfig(max_tokens=4), max_model_len=16)
    with pytest.raises(ValueError, match=r"2 of 3 prompts are too long \(longest 20.*max_tokens=4.*max_model_len=16"):
        check_prompt_lengths([[1] * 13, [1] * 2, [1] * 20], SamplingConfig(max_tokens=4), max_model_len=16)
    with pytest.raises(ValueError, match="empty prompts"):
        check_prompt_lengths([[1], []], SamplingConfig(max_tokens=4), max_model_len=16)


def test_registry_lists_engines_and_rejects_unknown_names():
    assert {"vllm", "megatron"} <= set(registered_engines())
    with pytest.raises(ValueError, match=r"rollout.engine='sglang'.*'megatron'"):
        build_engine("sglang")


def test_reference_sampler_filters_top_k_and_top_p():
    from megatron_gkd.rollout.megatron_engine import _sample

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = torch.Generator().manual_seed(0)

    def draws(**kwargs):
        config = SamplingConfig(**kwargs)
        return {_sample(logits, config, generator) for _ in range(200)}

    assert draws(temperature=0.0) == {0}
    assert draws(temperature=1.0) == {0, 1, 2, 3}
    assert draws(temperature=1.0, top_k=2) == {0, 1}
    assert draws(temperature=1.0, top_p=0.75) == {0, 1}  # 0.5 < 0.75, 0.8 reaches it
    assert draws(temperature=1.0, top_p=0.4) == {0}

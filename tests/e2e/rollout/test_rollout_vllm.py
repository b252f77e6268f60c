"""The vllm rollout engine in this process against float64 transformers on a tiny Llama.

One engine for the whole module (a vLLM start costs tens of seconds on CPU): greedy continuations,
grouped samples, rollout log-probs (1e-4), top-k ids, stop ids and the rejection of too-long prompts.
"""

import logging

import pytest
import torch

from megatron_gkd.rollout import SamplingConfig, build_engine
from megatron_gkd.testing.rollout import HFReference, assert_rollout_matches, make_rollout_checkpoint

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 96
PROMPTS = [[1, 17, 99, 3, 250], [1, 42], [1, 7, 7, 7, 8, 9, 10, 11, 12, 13, 14, 200, 31]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_rollout_checkpoint(tmp_path_factory.mktemp("rollout_llama"))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = build_engine("vllm", model=model_dir, max_model_len=MAX_MODEL_LEN,
                          skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFReference(model_dir)


def test_greedy_equals_transformers(engine, reference):
    batch = engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_tokens=12))
    assert batch.group_ids.tolist() == [0, 1, 2]
    assert batch.weight_version == 0
    for i, prompt in enumerate(PROMPTS):
        assert batch.prompt(i) == prompt
        expected = reference.greedy(prompt, 12)
        assert batch.response(i) == expected
        assert batch.finish_reasons[i] == ("length" if len(expected) == 12 else "stop")
    assert_rollout_matches(batch, reference)


def test_samples_are_grouped_with_logprobs_and_topk(engine, reference):
    sampling = SamplingConfig(temperature=1.0, max_tokens=10, n=3, seed=123, logprobs_k=5)
    batch = engine.generate(PROMPTS[:2], sampling)
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert [batch.prompt(i) for i in range(6)] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert len({tuple(batch.response(i)) for i in range(3)}) > 1, "the n samples of a prompt are all equal"
    assert batch.topk_ids is not None and batch.topk_ids.shape[2] == 5
    assert (batch.topk_ids[~batch.response_mask] == -1).all()
    assert_rollout_matches(batch, reference)
    again = engine.generate(PROMPTS[:2], sampling)
    assert torch.equal(again.response_ids, batch.response_ids), "a seeded batch is not reproducible"


def test_seeded_sampling_of_more_prompt_tokens_than_one_engine_step_takes(engine):
    """vLLM splits prompts over engine steps when a batch has more prompt tokens than a step takes (4,096), and then
    rewinds the seeded generator of a request whose prefill was cut, which vLLM's CPU build cannot do ("CPU Generator
    does not use offset"): 60 prompts of 80 tokens, seeded, sample and reproduce."""
    prompts = [[1] + [(7 * i + j) % 250 + 2 for j in range(79)] for i in range(60)]
    sampling = SamplingConfig(temperature=1.0, max_tokens=4, seed=5)
    batch = engine.generate(prompts, sampling)
    assert batch.num_samples == 60 and all(len(batch.response(i)) == 4 for i in range(60))
    assert torch.equal(engine.generate(prompts, sampling).response_ids, batch.response_ids)


def test_stop_token_ends_a_response(engine, reference):
    greedy = reference.greedy(PROMPTS[0], 8)
    stop = greedy[2]
    batch = engine.generate([PROMPTS[0]], SamplingConfig(temperature=0.0, max_tokens=8, stop_token_ids=[stop]))
    assert batch.response(0) == greedy[: greedy.index(stop) + 1]
    assert batch.finish_reasons == ["stop"]


def test_too_long_prompts_are_rejected_not_cut(engine):
    fits = [1] * (MAX_MODEL_LEN - 16)
    with pytest.raises(ValueError, match=r"2 of 3 prompts are too long.*max_tokens=16.*max_model_len=96"):
        engine.generate([fits, fits + [5], [1] * MAX_MODEL_LEN], SamplingConfig(max_tokens=16))
    assert engine.generate([fits], SamplingConfig(temperature=0.0, max_tokens=16)).num_samples == 1


def _checkpoint_weights(model_dir, **replaced) -> list:
    """Every tensor of the checkpoint (a weight sync sends them all), with ``replaced`` ones swapped in."""
    from safetensors.torch import load_file

    weights = load_file(f"{model_dir}/model.safetensors")
    return [(name, replaced.get(name.replace(".", "_"), tensor)) for name, tensor in weights.items()]


def test_load_weights_changes_outputs_and_version(engine, model_dir, reference):
    greedy = SamplingConfig(temperature=0.0, max_tokens=4)
    head = dict(_checkpoint_weights(model_dir))["lm_head.weight"]
    engine.load_weights(_checkpoint_weights(model_dir, lm_head_weight=torch.zeros_like(head)), version=1)
    try:
        batch = engine.generate(PROMPTS[:1], greedy)
        assert batch.weight_version == 1 and engine.weight_version == 1
        assert batch.response(0) == [0, 0, 0, 0]  # all logits equal: the first id wins
        torch.testing.assert_close(batch.logprobs(0), torch.full((4,), -torch.log(torch.tensor(256.0))))
    finally:
        engine.load_weights(_checkpoint_weights(model_dir), version=2)
    assert engine.generate(PROMPTS[:1], greedy).response(0) == reference.greedy(PROMPTS[0], 4)


def test_a_partial_reload_fails_naming_the_layers_left_out_but_not_the_rotary_cache(engine, model_dir, reference):
    """vLLM only warns "<layer>: Failed to load weights" for every layer a reload left out, and keeps the old
    tensors there: the load fails instead, naming them (megatron_gkd/weight_sync/reload_logs.py), and the engine
    refuses to generate until a complete load; the rotary cache, which no checkpoint holds, is never named."""
    from megatron_gkd.rollout import StaleWeightsError
    from megatron_gkd.weight_sync import WeightSyncError
    from megatron_gkd.weight_sync.reload_logs import LAYERWISE_LOGGER

    reported: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            reported.append(record.getMessage())

    handler = Collect()
    logging.getLogger(LAYERWISE_LOGGER).addHandler(handler)
    head = dict(_checkpoint_weights(model_dir))["lm_head.weight"]
    try:
        with pytest.raises(WeightSyncError, match=r"layers that got no weights: .*Linear.*weights not loaded: model\."
                           ) as raised:
            engine.load_weights([("lm_head.weight", head)], version=3)  # every other layer left out
    finally:
        logging.getLogger(LAYERWISE_LOGGER).removeHandler(handler)
    assert "Rotary" not in str(raised.value) and "lm_head" not in str(raised.value)
    assert not any("Failed to load weights" in line for line in reported), reported  # in the error, not the log
    with pytest.raises(StaleWeightsError, match="version 3"):
        engine.generate(PROMPTS[:1], SamplingConfig(temperature=0.0, max_tokens=4))
    engine.load_weights(_checkpoint_weights(model_dir), version=4)
    assert engine.generate(PROMPTS[:1], SamplingConfig(temperature=0.0, max_tokens=4)).response(0) == \
        reference.greedy(PROMPTS[0], 4)

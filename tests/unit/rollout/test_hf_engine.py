"""The ``hf`` rollout engine against a plain ``transformers`` forward (issue #32 item 2).

Its rollout log-probs are the raw log-softmax a forward of the unpadded prompt + response gives (float32, no KV cache),
for prompts of different lengths in one left-padded batch, and stay so as stopped rows leave the batch; stop ids,
the checkpoint's EOS and ``max_tokens`` end a response where they should; a seed repeats a batch, and a replica's
block of prompts repeats those rows of the whole batch; new weights change the samples and the version, and a load
that breaks part-way leaves the engine stale.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gkd.rollout import SamplingConfig, StaleWeightsError, build_engine
from megatron_gkd.testing.rollout import EOS_TOKEN_ID, make_rollout_checkpoint

PROMPTS = [[5, 17, 33, 9, 41], [7, 3, 60, 61, 62, 63, 64, 65, 66, 67, 68, 12], [90, 91, 92]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_rollout_checkpoint(tmp_path_factory.mktemp("hf_engine") / "student")


@pytest.fixture(scope="module")
def engine(checkpoint):
    return build_engine("hf", model=checkpoint, max_model_len=64)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@torch.no_grad()
def _raw_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """``[T, v]`` log-softmax rows of a plain forward (row t predicts response token t)."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_rollout_logprobs_are_a_plain_forwards_raw_log_softmax(engine, reference):
    sampling = SamplingConfig(n=2, temperature=0.8, top_k=50, top_p=0.9, max_tokens=6, seed=11, logprobs_k=4)
    batch = engine.generate(PROMPTS, sampling)
    assert batch.num_samples == 6 and batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert [batch.prompt(i) for i in range(6)] == [p for p in PROMPTS for _ in range(2)]
    assert batch.weight_version == 0 and batch.topk_ids.shape[2] == 4
    for i in range(batch.num_samples):
        response = batch.response(i)
        assert len(response) == 6 or batch.finish_reasons[i] == "stop"
        rows = _raw_logprobs(reference, batch.prompt(i), response)
        # Raw: temperature 1, unfiltered, whatever top-k/top-p/temperature sampled.
        torch.testing.assert_close(batch.logprobs(i), rows[torch.arange(len(response)), torch.tensor(response)],
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(batch.topk(i), torch.topk(rows, 4, dim=-1).indices)


def test_stop_ids_the_checkpoints_eos_and_max_tokens_end_a_response(engine, checkpoint, tmp_path):
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=8)
    full = engine.generate(PROMPTS, greedy)
    assert full.finish_reasons == ["length"] * 3 and full.response_lengths.tolist() == [8, 8, 8]
    stop = full.response(1)[3]
    cut = engine.generate(PROMPTS, SamplingConfig(n=1, temperature=0.0, max_tokens=8, stop_token_ids=(stop,)))
    for i in range(3):
        response = full.response(i)
        expected = response[: response.index(stop) + 1] if stop in response else response
        assert cut.response(i) == expected  # the stop id is kept, nothing after it
        assert cut.finish_reasons[i] == ("stop" if stop in response else "length")
        assert not cut.response_mask[i, len(expected):].any() and (cut.rollout_logprobs[i, len(expected):] == 0).all()
    assert engine.generate(PROMPTS, SamplingConfig(n=1, temperature=0.0, max_tokens=3)).response(0) == full.response(0)[:3]
    # The same weights with that token as the checkpoint's EOS: it stops without being asked, as in vLLM.
    assert stop != EOS_TOKEN_ID
    eos_engine = build_engine("hf", model=make_rollout_checkpoint(tmp_path / "eos", eos_token_id=stop), max_model_len=64)
    assert eos_engine.generate(PROMPTS, greedy).response(1) == cut.response(1)


def test_a_stopped_row_leaves_the_batch_and_the_others_decode_on_exactly(engine, reference):
    # A quarter of the ids stop a response: rows end at different steps, most before max_tokens.
    sampling = SamplingConfig(n=3, temperature=1.0, max_tokens=12, seed=3, stop_token_ids=tuple(range(0, 128, 4)))
    rows_per_forward = []
    hook = engine._model.register_forward_pre_hook(
        lambda module, args, kwargs: rows_per_forward.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        batch = engine.generate(PROMPTS, sampling)
    finally:
        hook.remove()
    lengths = batch.response_lengths.tolist()
    assert len(set(lengths)) > 2 and min(lengths) < 12, lengths  # the batch exercises rows ending apart
    # Forward t (t >= 1) decodes the rows whose response is longer than t tokens, and only those.
    assert rows_per_forward == [9] + [sum(length > t for length in lengths) for t in range(1, max(lengths))]
    for i in range(batch.num_samples):  # the survivors' KV cache rows stayed theirs
        response = batch.response(i)
        rows = _raw_logprobs(reference, batch.prompt(i), response)
        torch.testing.assert_close(batch.logprobs(i), rows[torch.arange(len(response)), torch.tensor(response)],
                                   atol=1e-5, rtol=0)
        assert (batch.finish_reasons[i] == "stop") == (response[-1] % 4 == 0 and response[-1] < 128)


def test_a_seed_repeats_the_batch_and_a_replicas_block_repeats_its_rows(engine):
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=6, seed=5)
    first = engine.generate(PROMPTS, sampling)
    assert first.response_ids.equal(engine.generate(PROMPTS, sampling).response_ids)
    other = engine.generate(PROMPTS, SamplingConfig(n=2, temperature=1.0, max_tokens=6, seed=6))
    assert not first.response_ids.equal(other.response_ids)
    assert first.response(0) != first.response(1)  # a prompt's samples differ
    # Replica 1 of 2 samples prompts 1.. with the seed shifted by one prompt (trainer/rollout_handle.py).
    block = engine.generate(PROMPTS[1:], SamplingConfig(n=2, temperature=1.0, max_tokens=6, seed=5 + 2))
    assert [block.response(i) for i in range(4)] == [first.response(i) for i in range(2, 6)]


def test_new_weights_change_the_samples_and_a_broken_load_leaves_it_stale(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = build_engine("hf", model=checkpoint, max_model_len=64)
    sampling = SamplingConfig(n=1, temperature=0.0, max_tokens=6)
    before = engine.generate(PROMPTS, sampling)
    other = AutoModelForCausalLM.from_pretrained(make_rollout_checkpoint(tmp_path / "other", seed=1), dtype=torch.float32)
    weights = list(other.state_dict().items())

    def broken():
        yield from weights[:3]
        raise RuntimeError("bucket 2: checksum 17 != sent 18")

    with pytest.raises(RuntimeError, match="checksum"):
        engine.load_weights(broken(), version=1)
    assert engine.stale and engine.weight_version == 0
    with pytest.raises(StaleWeightsError, match=r"version 1.*checksum 17"):
        engine.generate(PROMPTS, sampling)
    with pytest.raises(ValueError, match="'model.layers.9.mlp.up_proj.weight', which its model does not have"):
        engine.load_weights(iter([("model.layers.9.mlp.up_proj.weight", torch.zeros(2))]), version=1)
    assert engine.stale

    engine.load_weights(iter(weights), version=1)
    after = engine.generate(PROMPTS, sampling)
    assert not engine.stale and after.weight_version == 1
    assert not after.response_ids.equal(before.response_ids)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "other", dtype=torch.float32).eval()
    response = after.response(0)
    rows = _raw_logprobs(expected, PROMPTS[0], response)
    torch.testing.assert_close(after.logprobs(0), rows[torch.arange(len(response)), torch.tensor(response)],
                               atol=1e-5, rtol=0)
    # What weight sync's verify compares with the student's forward.
    got = engine.prompt_logprobs([PROMPTS[1]])
    with torch.no_grad():
        rows = torch.log_softmax(expected(input_ids=torch.tensor([PROMPTS[1]])).logits[0, :-1].double(), dim=-1)
    torch.testing.assert_close(got, rows.gather(1, torch.tensor(PROMPTS[1][1:])[:, None])[:, 0], atol=1e-6, rtol=0)


def test_refusals_name_the_setting(checkpoint, engine):
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=2: rollout engine 'hf' holds the whole model"):
        build_engine("hf", model=checkpoint, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="prompts are too long"):
        engine.generate([list(range(60))], SamplingConfig(max_tokens=8))
    with pytest.raises(ValueError, match="do not fit the model's 256-row vocabulary"):
        build_engine("hf", model=checkpoint, vocab_size=300)


def test_padding_rows_past_the_tokenizer_are_never_sampled(checkpoint, reference):
    engine = build_engine("hf", model=checkpoint, max_model_len=64, vocab_size=200)
    batch = engine.generate(PROMPTS, SamplingConfig(n=4, temperature=1.0, max_tokens=8, seed=0, logprobs_k=8))
    assert int(batch.response_ids.max()) < 200 and int(batch.topk_ids.max()) < 200
    response = batch.response(0)
    rows = _raw_logprobs(reference, PROMPTS[0], response)[:, :200].log_softmax(dim=-1)
    torch.testing.assert_close(batch.logprobs(0), rows[torch.arange(len(response)), torch.tensor(response)],
                               atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------- release_weights (issue #49)
def _student_weights(engine) -> dict[str, torch.Tensor]:
    """What a colocated sync would hand the engine: one tensor a parameter (the "student's"), by HF name."""
    return {name: param.detach().clone() for name, param in engine._model.named_parameters()}


def _plan_of(weights: dict[str, torch.Tensor]):
    from megatron_gkd.weight_sync import TensorSpec, WeightSyncPlan

    entries = tuple(TensorSpec(name=name, shape=tuple(t.shape), dtype="float32", pp_rank=0, vpp_chunk=0, tp_dim=None,
                               tp_size=1, expert=None, megatron="m." + name, part=0, fusion={"type": "Identity"},
                               position=i, owner=0, shards=(0,))
                    for i, (name, t) in enumerate(weights.items()))
    return WeightSyncPlan(entries=entries, trainer_world_size=1)


def test_after_a_release_and_a_restore_the_engine_samples_exactly_what_it_sampled_before(checkpoint):
    engine = build_engine("hf", model=checkpoint, max_model_len=64, release_weights=True)
    student = _student_weights(engine)
    engine.load_weights(iter(student.items()), version=1)
    sampling = SamplingConfig(n=2, temperature=1.0, top_p=0.9, max_tokens=6, seed=3, logprobs_k=2)
    before = engine.generate(PROMPTS, sampling)
    engine.release_weights()
    assert engine.stale and all(param.numel() == 0 for param in engine._model.parameters())
    engine.load_weights(iter(student.items()), version=2)  # the restore is the next sync: every weight
    after = engine.generate(PROMPTS, sampling)
    assert after.weight_version == 2 and after.response_ids.equal(before.response_ids)
    assert after.rollout_logprobs.equal(before.rollout_logprobs) and after.topk_ids.equal(before.topk_ids)


def test_a_releasing_engine_reads_the_tensors_it_is_handed_in_place_and_a_copying_one_does_not(checkpoint):
    student = _student_weights(build_engine("hf", model=checkpoint, max_model_len=64))
    for releases in (True, False):
        engine = build_engine("hf", model=checkpoint, max_model_len=64, release_weights=releases)
        engine.load_weights(iter(student.items()), version=1)
        shared = [param.data_ptr() == student[name].data_ptr() for name, param in engine._model.named_parameters()]
        assert all(shared) if releases else not any(shared)
    # A tensor of another dtype is converted into storage of the engine's own, never written into the handed one.
    doubles = {name: t.to(torch.float64) for name, t in student.items()}
    engine = build_engine("hf", model=checkpoint, max_model_len=64, release_weights=True)
    engine.load_weights(iter(doubles.items()), version=1)
    assert all(param.dtype == torch.float32 for param in engine._model.parameters())


def test_generate_and_scoring_while_released_raise_naming_the_setting_and_the_fix(checkpoint):
    engine = build_engine("hf", model=checkpoint, max_model_len=64, release_weights=True)
    engine.release_weights()
    message = r"version 0\) were released .*rollout.release_weights=true.*weight sync has restored"
    with pytest.raises(StaleWeightsError, match=message):
        engine.generate(PROMPTS, SamplingConfig(max_tokens=4))
    with pytest.raises(StaleWeightsError, match=message):
        engine.prompt_logprobs([PROMPTS[0]])
    with pytest.raises(RuntimeError, match="built without release_weights"):
        build_engine("hf", model=checkpoint, max_model_len=64).release_weights()


def test_a_sync_after_a_release_is_verified_and_one_with_other_weights_is_caught(checkpoint):
    from megatron_gkd.weight_sync import ColocatedReceiver, WeightSyncConfig, WeightSyncMismatch

    engine = build_engine("hf", model=checkpoint, max_model_len=64, release_weights=True)
    student = _student_weights(engine)
    config = WeightSyncConfig(transport="colocated", verify_prompts=(tuple(PROMPTS[1]),))
    expected = engine.prompt_logprobs(config.verify_prompts)  # the student's forward, as the trainer computes it
    receiver = ColocatedReceiver(_plan_of(student), config)
    engine.release_weights()
    receiver.sync(engine, iter(student.items()), version=1)
    assert receiver.verify(engine, expected, check=1e-6) == 0.0 and not engine.stale
    engine.release_weights()
    wrong = {**student, "lm_head.weight": torch.zeros_like(student["lm_head.weight"])}
    receiver.sync(engine, iter(wrong.items()), version=2)
    with pytest.raises(WeightSyncMismatch):
        receiver.verify(engine, expected, check=1e-3)
    assert engine.stale

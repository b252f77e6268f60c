"""Partial rollouts without a trainer: the buffer's bookkeeping (chunks, completion, oldest complete groups first),
the driver over several steps with a fake engine whose response lengths are skewed (every group is trained once, in
full, or is still in the buffer; carried samples continue with the new weights and record them), a resume from the
buffer's state, the driver with the real ``hf`` engine (each chunk continues prompt + tokens so far, with the weights
of its version), and the per-token versions through the flow into the micro-batches, the staleness bound (staler
tokens carry no coefficient, the mean is over the rest, and ``rollout/partial/masked_tokens`` counts them) and the
loss's staleness statistics."""

import concurrent.futures
import json
import pathlib
import types

import numpy as np
import pytest
import torch

from megatron_gkd.config import load_config
from megatron_gkd.data.dataset import PromptRecord
from megatron_gkd.rollout import build_engine
from megatron_gkd.rollout.types import RolloutBatch, decode_batch, encode_batch
from megatron_gkd.teacher import TeacherOutput
from megatron_gkd.testing.rollout import make_rollout_checkpoint
from megatron_gkd.trainer.flow import BatchFlow
from megatron_gkd.trainer.metrics import Timers, loss_metrics
from megatron_gkd.trainer.partial import PartialBuffer, PartialRollout, groups_batch
from megatron_gkd.trainer.step import StepRunner
from megatron_gkd.trainer.teachers import Teachers

BASE = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
EOS = 2
PROMPT_LEN = 3


def record(index: int, length: int) -> PromptRecord:
    """A prompt whose every response is ``length`` tokens long (the fake engine reads it from the first id)."""
    return PromptRecord(index=index, prompt_ids=(length, 7, 7), response_ids=None, answer=None)


class Engine:
    """Continues ``prompt + tokens so far``: token ``t`` of a response is ``10 + t``; a response stops (its last token
    EOS) at the length its prompt names, or is cut at ``max_tokens`` (finish ``length``). Records every call."""

    in_background = False

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling):
        assert sampling.n == 1
        self.calls.append([len(p) for p in prompts])
        responses, reasons = [], []
        for ids in prompts:
            done, target = len(ids) - PROMPT_LEN, ids[0]
            count = min(sampling.max_tokens, target - done)
            tokens = [10 + done + t for t in range(count)]
            stopped = done + count == target
            if stopped:
                tokens[-1] = EOS
            responses.append(tokens)
            reasons.append("stop" if stopped else "length")
        return RolloutBatch.from_samples(prompts, responses, [[-0.5] * len(r) for r in responses], range(len(prompts)),
                                         reasons, weight_version=-1)


def _config(*overrides):
    return load_config(BASE, ["trainer.scheduler=partial", "rollout.max_tokens=24", "rollout.partial.chunk_tokens=4",
                              *overrides])


class Data:
    """Prompts in order; every fifth is long (20 tokens), the rest short (1-3 tokens)."""

    def __init__(self):
        self.next = 0

    def draw(self, count=None):
        count = 4 if count is None else count
        drawn = [record(self.next + i, 20 if (self.next + i) % 5 == 4 else 1 + (self.next + i) % 3) for i in range(count)]
        self.next += count
        return drawn


def _driver(config, engine):
    return PartialRollout(config, engine, prompts_per_step=4, pad_id=0)


def test_the_buffer_continues_in_chunks_and_hands_out_the_oldest_complete_groups():
    buffer = PartialBuffer(n=2, chunk_tokens=4, max_tokens=10, capacity=3)
    assert buffer.admit([record(0, 9), record(1, 2)], step=0) == [0, 1]
    work = buffer.pending()
    assert [(w.group, w.sample, w.budget) for w in work] == [(0, 0, 4), (0, 1, 4), (1, 0, 4), (1, 1, 4)]
    for w in work:
        buffer.extend(w, [1] * (4 if w.group == 0 else 2), [-1.0] * (4 if w.group == 0 else 2),
                      "length" if w.group == 0 else "stop", version=0)
    assert buffer.num_complete == 1 and buffer.num_unfinished_samples == 2 and buffer.room == 1
    # Group 0 continues with the next version; its last round has 2 tokens of budget left (max_tokens 10).
    for version in (1, 2):
        for w in buffer.pending():
            buffer.extend(w, [1] * w.budget, [-1.0] * w.budget, "length", version=version)
    assert buffer.groups[0].complete and buffer.groups[0].samples[0].finish == "length"
    assert buffer.groups[0].samples[0].versions == [0] * 4 + [1] * 4 + [2] * 2
    assert [g.uid for g in buffer.take(2)] == [0, 1] and not buffer.groups
    with pytest.raises(AssertionError):
        buffer.take(1)


def test_the_driver_never_waits_for_long_samples_and_trains_every_group_once():
    engine, data = Engine(), Data()
    driver = _driver(_config(), engine)
    trained, admitted = [], []
    for step in range(8):
        groups, metrics = driver.sample(step, data.draw, version=step, seed=0)
        assert len(groups) == 4 and all(g.complete and len(g.samples) == 4 for g in groups)
        assert metrics["rollout/partial/trained_uids"] == [g.uid for g in groups]
        trained += [g.uid for g in groups]
        admitted += metrics["rollout/partial/admitted_uids"]
        for group in groups:  # every token of a response was sampled by the weights of its round's step
            for sample in group.samples:
                assert len(sample.versions) == len(sample.tokens) == sample.tokens.index(EOS) + 1
                assert sample.tokens[:-1] == [10 + t for t in range(len(sample.tokens) - 1)]
                assert sample.versions == sorted(sample.versions) and sample.versions[-1] <= step
        # No step waits for the long samples (20 tokens, 5 chunks): they continue over the next steps.
        assert metrics["rollout/partial/rounds"] <= 2
    assert max(max(call) for call in engine.calls) <= PROMPT_LEN + 24 - 4
    assert len(trained) == len(set(trained)), "a group was trained twice"
    in_buffer = [g.uid for g in driver.buffer.groups]
    assert sorted(trained + in_buffer) == sorted(admitted) == list(range(len(admitted)))  # none lost
    assert any(g.record.prompt_ids[0] == 20 for g in driver.buffer.groups), "no long sample carried at the end"
    assert len(driver.buffer.groups) <= 8  # twice the prompts of a step


def test_a_long_sample_continues_with_the_new_weights():
    engine, data = Engine(), Data()
    driver = _driver(_config(), engine)
    seen = {}
    for step in range(10):
        groups, _ = driver.sample(step, data.draw, version=100 + step, seed=0)
        for group in groups:
            if group.record.prompt_ids[0] == 20:
                seen[group.uid] = (group.admitted, group.samples[0].versions)
    assert seen, "no long group finished in 10 steps"
    for admitted, versions in seen.values():  # 20 tokens in chunks of 4: five rounds, more than one version
        assert len(versions) == 20 and len(set(versions)) > 1 and versions[0] >= 100 + admitted


def test_resume_from_the_buffer_state_continues_exactly():
    config = _config()
    reference, data = _driver(config, Engine()), Data()
    expected = [reference.sample(step, data.draw, version=step, seed=0)[0] for step in range(6)]
    first, data = _driver(config, Engine()), Data()
    for step in range(3):
        first.sample(step, data.draw, version=step, seed=0)
    state = json.loads(json.dumps(first.state_dict()))  # plain types: what a checkpoint holds
    assert any(s["finish"] is None for g in state["groups"] for s in g["samples"]), "nothing unfinished to carry"
    resumed = _driver(config, Engine())
    resumed.load_state_dict(state)
    for step in range(3, 6):
        groups, _ = resumed.sample(step, data.draw, version=step, seed=0)
        assert [(g.uid, g.record, [s.tokens for s in g.samples], [s.versions for s in g.samples]) for g in groups] == \
            [(g.uid, g.record, [s.tokens for s in g.samples], [s.versions for s in g.samples]) for g in expected[step]]


def test_the_batch_of_trained_groups_records_each_tokens_version():
    driver, data = _driver(_config(), Engine()), Data()
    for step in range(4):
        groups, _ = driver.sample(step, data.draw, version=step, seed=0)
    batch = groups_batch(groups, pad_token_id=0)
    assert batch.num_samples == 16 and batch.group_ids.tolist() == [i // 4 for i in range(16)]
    for i in range(16):
        assert batch.versions(i).tolist() == groups[i // 4].samples[i % 4].versions
    assert batch.weight_version == int(batch.token_versions[batch.response_mask].min())
    assert torch.equal(decode_batch(encode_batch(batch)).token_versions, batch.token_versions)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine=megatron"], "rollout.engine"), (["sample_mix.lmbda=0.5"], "sample_mix"),
    (["trainer.mode=off_policy", "rollout.n=1"], "trainer.mode"), (["trainer.token_budget=100"], "trainer.token_budget"),
    (["trainer.scheduler=partial_one_step_off", "sample_mix.lmbda=0.5"], "sample_mix"),
    (["loss.confidence_alpha=0.5", "rollout.partial.max_staleness=1"], "loss.confidence_alpha"),
])
def test_what_partial_rollouts_do_not_support_is_refused_by_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(*overrides)


# ------------------------------------------------------------------------------------- the real hf engine
STOP_IDS = tuple(range(100, 132))  # greedy responses of the tiny checkpoints stop at one of these, or run on


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """Two tiny Llama checkpoints: the weights of versions 0 and 1."""
    root = tmp_path_factory.mktemp("partial_hf")
    return make_rollout_checkpoint(root / "v0"), make_rollout_checkpoint(root / "v1", seed=1)


class VariedPrompts:
    """Prompts in order, of 2 to 5 distinct ids (rows of different lengths share an engine call)."""

    def __init__(self):
        self.next = 0

    def draw(self, count):
        drawn = [PromptRecord(index=i, prompt_ids=tuple(5 + 7 * i + t for t in range(2 + i % 4)), response_ids=None,
                              answer=None) for i in range(self.next, self.next + count)]
        self.next += count
        return drawn


def test_the_hf_engine_continues_unfinished_samples_from_prompt_and_tokens_so_far(hf_checkpoints):
    from transformers import AutoModelForCausalLM

    config = _config("rollout.engine=hf", "rollout.tensor_parallel_size=1", "rollout.kv_cache_memory_mb=null",
                     "rollout.temperature=0", "rollout.n=2", "rollout.max_tokens=10",
                     f"rollout.stop_token_ids=[{','.join(map(str, STOP_IDS))}]")  # accepted: hf has weights of its own
    engine = build_engine("hf", model=hf_checkpoints[0], max_model_len=64)
    models = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for path in hf_checkpoints]
    driver, data = PartialRollout(config, engine, prompts_per_step=2, pad_id=0), VariedPrompts()
    checked = set()
    for step in range(6):
        if step == 2:  # an update: carried samples continue with the new weights
            engine.load_weights(iter(models[1].state_dict().items()), version=1)
        groups, _ = driver.sample(step, data.draw, version=engine.weight_version, seed=0)
        for group in groups:
            for sample in group.samples:
                prompt, tokens = list(group.record.prompt_ids), sample.tokens
                assert sample.versions == sorted(sample.versions) and len(sample.versions) == len(tokens)
                stops = [t in STOP_IDS for t in tokens]
                assert not any(stops[:-1]) and sample.finish == ("stop" if stops[-1] else "length")
                assert sample.finish == "stop" or len(tokens) == 10
                for version in set(sample.versions):
                    # Greedy under the weights of its version, given the prompt and every token before it; the
                    # log-prob is that forward's raw log-softmax.
                    with torch.no_grad():
                        logits = models[version](input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
                    rows = torch.log_softmax(logits.float(), dim=-1)  # [T, v]
                    at = [t for t, v in enumerate(sample.versions) if v == version]
                    picked = rows[at, torch.tensor(tokens)[at]]
                    torch.testing.assert_close(torch.tensor(sample.logprobs)[at], picked, atol=1e-5, rtol=0)
                    assert (picked >= rows[at].max(dim=-1).values - 1e-5).all()
                checked.add((sample.finish, len(set(sample.versions))))
    assert {("stop", 1), ("length", 1), ("length", 2)} <= checked, f"not every case was seen: {checked}"


# ---------------------------------------------------------------------------------------- through the flow
class Client:
    """Scores every response token with top-k ids ``0..k-1``."""

    num_retries = 0

    def score_async(self, batch):
        future = concurrent.futures.Future()
        outputs = []
        for sequence in batch.sequences:
            length = len(sequence.response_ids)
            outputs.append(TeacherOutput(topk_ids=np.tile(np.arange(batch.top_k), (length, 1)),
                                         topk_logprobs=np.tile(-np.arange(1.0, batch.top_k + 1, dtype=np.float32),
                                                               (length, 1)),
                                         token_logprobs=np.full(length, -0.5, dtype=np.float32)))
        future.set_result(outputs)
        return future


class Tokenizer:
    pad_token_id = 0

    def __len__(self):
        return 512


def _flow(*overrides):
    config = _config(*overrides)
    teachers = Teachers(config)
    teachers.by_name["teacher"].client = Client()
    state = types.SimpleNamespace(is_pipeline_last_stage=True, tp_rank=0, dp_rank=0, data_parallel_size=1, tp_group=None)
    return BatchFlow(config, state, control=None, dp_group=None, tokenizer=Tokenizer(), timers=Timers(),
                     teachers=teachers, rollout=Engine(), stop_ids=(EOS,))


@pytest.mark.parametrize("bound", [None, 1])
def test_per_token_versions_reach_the_loss(gloo_world, bound):  # conftest.py: a gloo world of one process
    flow = _flow(*([] if bound is None else [f"rollout.partial.max_staleness={bound}"]))
    data = Data()
    staleness_seen = 0.0
    for step in range(6):
        batch = flow.produce_batch(step, data.draw, flow.data_state({"position": step}), version=step)
        prepared = flow.prepare(batch)
        total = torch.zeros((), dtype=torch.float64)
        stats = {"tokens": 0.0, "token_staleness": 0.0, "token_staleness_max": 0.0}
        for mb in prepared.microbatches:
            assert mb.version == step
            versions = mb.token_versions[mb.loss_mask]
            assert (versions >= 0).all() and (versions <= step).all() and (mb.token_versions[~mb.loss_mask] == -1).all()
            staleness = step - mb.token_versions
            trained = mb.loss_mask & (mb.coefficients != 0)
            if bound is not None:  # tokens staler than the bound carry no coefficient
                assert not (mb.loss_mask & (staleness > bound) & (mb.coefficients != 0)).any()
            total += mb.coefficients.sum()
            part = StepRunner._staleness_stats(mb, mb.loss_mask)
            assert float(part["token_staleness"]) == float(staleness[mb.loss_mask].sum())
            assert float(part["token_staleness_max"]) == float(staleness[trained].max()) if trained.any() else True
            stats["tokens"] += float(mb.loss_mask.sum())
            stats["token_staleness"] += float(part["token_staleness"])
            stats["token_staleness_max"] = max(stats["token_staleness_max"], float(part["token_staleness_max"]))
        assert float(total) == pytest.approx(1.0)  # the mean over the tokens that train
        metrics = prepared.metrics
        assert metrics["rollout/partial/token_staleness_max"] == float(step - batch.rollout.weight_version)
        if bound is None:
            assert metrics["rollout/partial/masked_tokens"] == 0
        shown = loss_metrics({"loss": 0.0, **stats})
        assert shown["train/token_staleness_mean"] == pytest.approx(metrics["rollout/partial/token_staleness_mean"])
        assert bound is None or shown["train/token_staleness_max"] <= bound
        staleness_seen = max(staleness_seen, metrics["rollout/partial/token_staleness_max"])
    assert staleness_seen >= 2, "no sample was carried over two updates: the test shows nothing"


@pytest.mark.parametrize("bound", [0, 2])
def test_a_staleness_bound_masks_staler_tokens_out_of_the_loss_and_counts_them(gloo_world, bound):
    flow, data = _flow(f"rollout.partial.max_staleness={bound}"), Data()
    masked_steps = 0
    for step in range(8):
        batch = flow.produce_batch(step, data.draw, flow.data_state({"position": step}), version=step)
        prepared = flow.prepare(batch)
        metrics = prepared.metrics
        # Counted from the versions the buffer recorded for each sample, not from the flow's own staleness.
        staleness = [step - v for i in range(batch.rollout.num_samples) for v in batch.rollout.versions(i).tolist()]
        stale = sum(s > bound for s in staleness)
        masked, kept, largest = 0, [], 0.0
        for mb in prepared.microbatches:
            trained = mb.loss_mask & (mb.coefficients != 0)
            masked += int((mb.loss_mask & (mb.coefficients == 0)).sum())
            assert ((step - mb.token_versions[trained]) <= bound).all()
            kept.append(mb.coefficients[trained])
            largest = max(largest, float(StepRunner._staleness_stats(mb, mb.loss_mask)["token_staleness_max"]))
        assert masked == stale == metrics["rollout/partial/masked_tokens"]
        # The loss is the token mean over the tokens within the bound: each carries 1 / their number.
        kept = torch.cat(kept)
        assert kept.numel() == len(staleness) - stale
        torch.testing.assert_close(kept, torch.full_like(kept, 1.0 / kept.numel()), atol=0, rtol=1e-12)
        assert largest == max(s for s in staleness if s <= bound) <= bound  # the loss's train/token_staleness_max
        assert metrics["rollout/partial/token_staleness_max"] == max(staleness)
        masked_steps += stale > 0
    assert masked_steps >= 2, "the bound masked nothing: the test shows nothing"

"""The policy-gradient step (``rl.combine``) on a real Megatron student: its loss and gradients do not depend on
the layout (TP=2, PP=2, DP=2, EP=2 against one rank) or on the micro-batch cut, for each of the three combinations,
fused and unfused; and its figures are the ones the batch defines (at ratio 1 the policy-gradient loss is
``-sum(coefficient x advantage)``, GRPO's advantages computed here by hand)."""

import types

import numpy as np
import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

VOCAB = 512
REAL_VOCAB = VOCAB - 3  # the table has padding rows past it
NUM_GROUPS, N = 4, 3  # an even split over two data-parallel ranks: expert parallelism runs as many micro-batches
TOP_K = 8
KD_COEF = 0.5


def _batch():
    """Samples (with the rollout engine's log-probs), their rewards and their teacher outputs (top-k rows)."""
    from megatron_gkd.teacher import TeacherOutput
    from megatron_gkd.trainer.batch import Sample

    rng = np.random.default_rng(5)
    samples, outputs = [], []
    rewards = rng.integers(0, 2, NUM_GROUPS * N).astype(float)
    rewards[:N] = 1.0  # a group of equal rewards: advantages 0
    for group in range(NUM_GROUPS):
        prompt = rng.integers(3, REAL_VOCAB, rng.integers(2, 6)).tolist()
        for _ in range(N):
            response = rng.integers(3, REAL_VOCAB, rng.integers(1, 9)).tolist()
            behaviour = torch.from_numpy(rng.uniform(-7.0, -5.0, len(response))).float()
            samples.append(Sample(tokens=torch.tensor(prompt + response), prompt_len=len(prompt), group=group,
                                  prompt_index=group, logprobs=behaviour))
            logits = rng.normal(size=(len(response), REAL_VOCAB)) * 2
            logprobs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
            order = np.argsort(-logprobs, axis=1)[:, :TOP_K]
            outputs.append(TeacherOutput(
                topk_ids=order.astype(np.int64), topk_logprobs=np.take_along_axis(logprobs, order, 1).astype(np.float32),
                token_logprobs=logprobs[np.arange(len(response)), response].astype(np.float32)))
    return samples, rewards, outputs


def _config(combine: str, tis_cap=None, baseline=False):
    from megatron_gkd.config.schema import RLConfig

    return types.SimpleNamespace(rl=RLConfig(combine=combine, kd_coef=KD_COEF, advantage="grpo",
                                             aggregation="sequence_mean", kl_estimator="k1", tis_cap=tis_cap,
                                             teacher_baseline=baseline),
                                 rollout=types.SimpleNamespace(max_tokens=8))


# (combine, fused, tis_cap, rl.teacher_baseline)
CASES = [("loss", False, None, False), ("loss", True, None, False), ("advantage", False, 2.0, False),
         ("advantage", True, None, False), ("teacher", False, None, False), ("teacher", True, None, True)]


def _body(checkpoint: str, layout: dict, cuts: tuple):
    """Per case and cut: the step's statistics, the output layer's gradient (last stage) and the embedding's
    gradient (first stage)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf, unwrap
    from megatron_gkd.trainer.batch import TeacherShare, build_microbatch, teacher_rows, token_coefficients
    from megatron_gkd.trainer.optim import OptimizerConfig, build_optimizer, wrap_for_training
    from megatron_gkd.trainer.policy import policy_share
    from megatron_gkd.trainer.specs import LossSpec, PolicySpec
    from megatron_gkd.trainer.step import StepRunner

    state = parallel.initialize(**layout)
    parallel.seed(0)
    optim = OptimizerConfig(lr=1e-3)
    chunks = wrap_for_training(load_hf(checkpoint), optim)
    runner = StepRunner(chunks, build_optimizer(optim, chunks), None, tp_group=state.tp_group,
                        dp_group=mpu.get_data_parallel_group_gloo(), dp_size=state.data_parallel_size,
                        is_last_stage=state.is_pipeline_last_stage)
    samples, rewards, outputs = _batch()
    num_tokens, num_sequences = sum(s.response_len for s in samples), len(samples)
    groups = set(np.array_split(np.arange(NUM_GROUPS), state.data_parallel_size)[state.dp_rank].tolist())
    mine = [i for i, s in enumerate(samples) if s.group in groups]
    samples, rewards, outputs = [samples[i] for i in mine], torch.tensor(rewards[mine]), [outputs[i] for i in mine]
    lengths = [s.response_len for s in samples]
    rows = teacher_rows(outputs, samples)
    coefficients = token_coefficients(samples, total_tokens=num_tokens, num_groups=NUM_GROUPS)
    gpt = unwrap(chunks[0])
    results = {}
    for combine, fused, tis_cap, baseline in CASES:
        config = _config(combine, tis_cap, baseline)
        share = policy_share(config, samples, rewards, {"teacher": (list(range(len(samples))), rows)}, {"teacher": 1.0},
                             num_tokens=num_tokens, num_sequences=num_sequences)
        teachers = [TeacherShare("teacher", rows.split(lengths), [c * KD_COEF for c in coefficients])] \
            if config.rl.combination.uses_divergence else []
        runner.policy = PolicySpec(combination=config.rl.combination, estimator="k1",
                                   options=config.rl.options, fused=fused, chunk_size=5, real_vocab_size=REAL_VOCAB)
        for cut in cuts:
            plan = [list(range(len(samples)))] if cut == "one" else [[i] for i in range(len(samples))]
            # Pipeline stages exchange one shape; expert-parallel ranks dispatch tokens of micro-batches of one shape.
            shape = (max(map(len, plan)), 16) if set(layout) & {"pipeline_model_parallel_size",
                                                                 "expert_model_parallel_size"} else None
            microbatches = [build_microbatch([samples[i] for i in mb], [coefficients[i] for i in mb],
                                             teachers=[t.take(mb) for t in teachers], policy=share.take(mb), shape=shape,
                                             version=0, sampled=(0, False))
                            for mb in plan]
            for chunk in chunks:
                chunk.zero_grad_buffer()
            stats = runner.run(LossSpec(loss_type="forward_kl", fused=fused, chunk_size=5, real_vocab_size=REAL_VOCAB),
                               microbatches, forward_only=False)
            for chunk in chunks:
                chunk.finish_grad_sync()
            output = gpt.output_layer.weight.main_grad.clone() if gpt.post_process else None
            embedding = gpt.embedding.word_embeddings.weight.main_grad.clone() if gpt.pre_process else None
            results[(combine, fused, cut)] = (stats, output, embedding)
    parallel.destroy()
    return dist.get_rank(), state.tp_rank, results


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from megatron_gkd.recipes.tiny import build_checkpoint

    return str(build_checkpoint(tmp_path_factory.mktemp("student"), vocab_size=VOCAB, seed=3))


@pytest.fixture(scope="module")
def single(checkpoint):
    (_, _, results), = run_distributed(_body, 1, args=(checkpoint, {}, ("one", "singles")))
    return results


def _close(a, b, what):
    # fp32 sums in another order: a few ulps of the largest entries (the teacher's k1 advantages are large: the
    # random teacher is far from the student); a wrong coefficient or advantage is orders larger.
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=lambda m: f"{what}: {m}")


def _grpo(rewards: np.ndarray) -> np.ndarray:
    table = rewards.reshape(NUM_GROUPS, N)
    return ((table - table.mean(1, keepdims=True)) / (table.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)


def _baseline_sum(samples) -> float:
    """The teacher baseline summed over every token, by hand: for each token the mean k1 (sampler's log-prob less the
    teacher's) of the other samples of its group that reach its position."""
    _, _, outputs = _batch()
    k1 = [s.logprobs.double() - torch.from_numpy(o.token_logprobs).double() for s, o in zip(samples, outputs)]
    total = 0.0
    for i, sample in enumerate(samples):
        for t in range(sample.response_len):
            others = [k1[j][t] for j, other in enumerate(samples)
                      if j != i and other.group == sample.group and other.response_len > t]
            total += float(sum(others) / len(others)) if others else 0.0
    return total


def test_the_step_figures_are_the_batch_s(single):
    samples, rewards, _ = _batch()
    advantages = _grpo(rewards)
    for (combine, _fused, _cut), (stats, _, _) in single.items():
        tokens = sum(s.response_len for s in samples)
        assert stats["pg/tokens"] == tokens
        if combine == "teacher":
            # reward 0: the advantage is -kd_coef x k1 of the teacher (k1's sign is the sampled tokens': no bound),
            # less the baseline (the fused case): the other samples' k1 at each position
            assert stats["pg/teacher_kl"] != 0
            baseline = _baseline_sum(samples) if _fused else 0.0
            assert baseline != 0 or not _fused
            assert stats["pg/advantage"] == pytest.approx(-KD_COEF * (stats["pg/teacher_kl"] - baseline), rel=1e-5)
            continue
        # sequence_mean: each response's tokens weigh 1 / (S R_i); at ratio 1 the loss is -sum(coefficient x A)
        expected = -sum(a for a in advantages) / len(samples)
        teacher_part = KD_COEF * stats["pg/teacher_kl"] if combine == "advantage" else 0.0
        # float32 per-token advantages: the sum carries the rounding of the teacher's (large) KL estimates
        assert stats["pg/advantage"] + teacher_part == pytest.approx(
            sum(a * s.response_len for a, s in zip(advantages, samples)), abs=1e-5 + 1e-6 * abs(teacher_part))
        if combine == "loss":
            assert stats["pg/loss"] == pytest.approx(expected, abs=1e-5)
            assert stats["loss"] == pytest.approx(stats["pg/loss"] + stats["kd/loss"], rel=1e-6)
            assert stats["kd/loss"] > 0
        # behaviour log-probs in [-7, -5] against the student's own: the mismatch is measured, never NaN
        assert stats["mismatch/max_ratio"] > 1 and stats["mismatch/k3"] > 0
    assert "pg/tis_weight" in single[("advantage", False, "one")][0]


def test_cut_fused_and_unfused_agree(single):
    for (combine, fused, cut), (stats, output, embedding) in single.items():
        reference, reference_output, reference_embedding = single[(combine, False, "one")]
        if combine != "loss" and fused != False:  # noqa: E712 - the unfused case has tis_cap (advantage), the fused
            continue  # case the teacher baseline (teacher)
        for key in ("loss", "pg/loss", "pg/advantage"):
            assert stats[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), (combine, fused, cut, key)
        _close(output, reference_output, f"{combine} fused={fused} {cut} output layer")
        _close(embedding, reference_embedding, f"{combine} fused={fused} {cut} embedding")


LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
    "dp2": {},
}


@pytest.mark.parametrize("layout", ["tp2", "pp2", pytest.param("dp2", marks=pytest.mark.slow)])
def test_layouts_equal_one_rank(checkpoint, single, layout):
    settings = LAYOUTS[layout]
    for rank, tp_rank, results in run_distributed(_body, 2, args=(checkpoint, settings, ("singles",))):
        for (combine, fused, cut), (stats, output, embedding) in results.items():
            reference, reference_output, reference_embedding = single[(combine, fused, cut)]
            what = f"{layout} rank {rank} {combine} fused={fused}"
            if output is not None:
                if layout == "tp2":
                    reference_output = reference_output[tp_rank * VOCAB // 2:(tp_rank + 1) * VOCAB // 2]
                _close(output, reference_output, f"{what} output layer")
                for key in ("loss", "pg/loss", "pg/advantage", "mismatch/k1"):
                    assert stats[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), (what, key)
                assert stats["mismatch/max_ratio"] == pytest.approx(reference["mismatch/max_ratio"], rel=1e-5), what
            if embedding is not None and layout != "tp2":
                _close(embedding, reference_embedding, f"{what} embedding")


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from megatron_gkd.recipes.tiny import build_checkpoint

    return str(build_checkpoint(tmp_path_factory.mktemp("moe_student"), vocab_size=VOCAB, seed=3, num_experts=4,
                                intermediate_size=64))


def test_expert_parallel_equals_one_rank(moe_checkpoint):
    # Expert parallelism over the data-parallel ranks: each rank trains its own share, the experts are split. One
    # sample per micro-batch: the load-balancing loss is per micro-batch, so the cut must match the single rank's.
    (_, _, single_moe), = run_distributed(_body, 1, args=(moe_checkpoint, {}, ("singles",)))
    for rank, _, results in run_distributed(_body, 2, args=(moe_checkpoint, dict(expert_model_parallel_size=2),
                                                            ("singles",))):
        for key, (stats, output, embedding) in results.items():
            reference, reference_output, reference_embedding = single_moe[key]
            what = f"ep2 rank {rank} {key}"
            for name in ("loss", "pg/loss", "pg/advantage"):
                assert stats[name] == pytest.approx(reference[name], rel=1e-5, abs=1e-7), (what, name)
            _close(output, reference_output, f"{what} output layer")
            _close(embedding, reference_embedding, f"{what} embedding")


# The clip under staleness (issue #46): two updates of one batch (two PPO epochs, or two mini-batches), the second
# against the log-probs the trainer recorded before the first. With SGD at this rate and this narrow range a second
# epoch finds about half of the tokens clipped (ratios from 0.8 to 2.5: both sides, and the dual clip on negative
# advantages), the other half not.
CLIP = dict(clip_low=0.05, clip_high=0.05, clip_ratio_c=1.1)
CLIP_LR = 1e-3


def _clip_body(checkpoint: str, fused: bool, epochs: int, mini_batches: int, lr: float = CLIP_LR):
    """Trains one batch of two micro-batches with ``rl.ppo_epochs=epochs``, ``rl.mini_batches=mini_batches``; at each
    optimizer step records the output layer's gradient and the final hidden states and output weight it was taken at.
    Returns the step's statistics, the micro-batches and the records."""
    from megatron.core import parallel_state as mpu

    from megatron_gkd import parallel
    from megatron_gkd.config.schema import RLConfig
    from megatron_gkd.models import load_hf, unwrap
    from megatron_gkd.models.output_layer import capture_output_layer
    from megatron_gkd.trainer.batch import build_microbatch, teacher_rows, token_coefficients
    from megatron_gkd.trainer.optim import OptimizerConfig, build_optimizer, wrap_for_training
    from megatron_gkd.trainer.policy import policy_share
    from megatron_gkd.trainer.specs import LossSpec, PolicySpec
    from megatron_gkd.trainer.step import StepRunner

    state = parallel.initialize()
    parallel.seed(0)
    optim = OptimizerConfig(optimizer="sgd", lr=lr, clip_grad=0.0)
    chunks = wrap_for_training(load_hf(checkpoint), optim)
    optimizer = build_optimizer(optim, chunks)
    rl = RLConfig(combine="advantage", kd_coef=KD_COEF, advantage="grpo", aggregation="token_mean",
                  ppo_epochs=epochs, mini_batches=mini_batches, **CLIP)
    policy = PolicySpec.from_config(types.SimpleNamespace(rl=rl, rollout=types.SimpleNamespace(temperature=1.0),
                                                          loss=types.SimpleNamespace(fused=fused, chunk_size=5)),
                                    REAL_VOCAB)
    runner = StepRunner(chunks, optimizer, types.SimpleNamespace(step=lambda increment: None), tp_group=state.tp_group,
                        dp_group=mpu.get_data_parallel_group_gloo(), dp_size=1, is_last_stage=True, policy=policy)
    samples, rewards, outputs = _batch()
    num_tokens = sum(s.response_len for s in samples)
    rows = teacher_rows(outputs, samples)
    coefficients = token_coefficients(samples, total_tokens=num_tokens, num_groups=NUM_GROUPS)
    config = types.SimpleNamespace(rl=rl, rollout=types.SimpleNamespace(max_tokens=8))
    share = policy_share(config, samples, torch.tensor(rewards), {"teacher": (list(range(len(samples))), rows)},
                         {"teacher": 1.0}, num_tokens=num_tokens, num_sequences=len(samples))
    microbatches = [build_microbatch([samples[i] for i in mb], [coefficients[i] for i in mb], policy=share.take(mb),
                                     version=0, sampled=(0, False)) for mb in ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])]
    gpt = unwrap(chunks[0])
    records, step = [], optimizer.step

    def recording_step():
        with torch.no_grad(), capture_output_layer(chunks[0], state.tp_group) as captured:
            hidden = [chunks[0](mb.tokens, mb.position_ids, attention_mask=None) for mb in microbatches]
        records.append((gpt.output_layer.weight.main_grad.clone(), [h.double() for h in hidden],
                        captured.weight.detach().double().clone()))
        return step()

    optimizer.step = recording_step
    stats, _ = runner.train_step(LossSpec(loss_type="forward_kl", fused=fused, chunk_size=5,
                                          real_vocab_size=REAL_VOCAB), microbatches)
    parallel.destroy()
    return stats, [(mb.tokens, mb.policy, mb.sampled, mb.loss_mask) for mb in microbatches], records


# A mini-batch moves the other's tokens less than its own: a larger step.
@pytest.mark.parametrize("fused, epochs, mini_batches, lr", [(False, 2, 1, CLIP_LR), (True, 2, 1, CLIP_LR),
                                                             (False, 1, 2, 10 * CLIP_LR)])
def test_a_second_update_is_clipped_as_the_float64_reference_says(checkpoint, fused, epochs, mini_batches, lr):
    from megatron_gkd.losses.reference import reference_policy_gradient_loss, reference_token_logprobs

    (stats, microbatches, records), = run_distributed(_clip_body, 1, args=(checkpoint, fused, epochs, mini_batches,
                                                                                  lr))
    assert len(records) == 2  # two optimizer steps on one batch

    def per_token(hidden, weight):  # the float64 logits of each micro-batch's loss positions, flattened
        return [((h @ weight.t())[mask], sampled.token_ids[mask], policy, mask)
                for h, (_, policy, sampled, mask) in zip(hidden, microbatches)]

    first = per_token(records[0][1], records[0][2])
    old = [reference_token_logprobs(logits, ids, real_vocab_size=REAL_VOCAB) for logits, ids, _, _ in first]
    clipped = 0
    for update, (grad, hidden, weight) in enumerate(records):
        weight = weight.clone().requires_grad_()
        total = 0.0
        for index, ((logits, ids, policy, mask), old_logprobs) in enumerate(zip(per_token(hidden, weight), old)):
            if mini_batches > 1 and index != update:  # a mini-batch (one micro-batch here) per update
                continue
            # the advantage is fixed over the epochs: the teacher's k1 at the log-probs recorded before the first
            advantages = policy.advantages[mask] - KD_COEF * (old_logprobs - policy.teacher_logprobs[mask].double())
            loss = reference_policy_gradient_loss(logits, ids, advantages, old_logprobs, real_vocab_size=REAL_VOCAB,
                                                  **CLIP)
            total = total + mini_batches * (loss * policy.coefficients[mask]).sum()  # a mini-batch weighs as a batch
            ratio = torch.exp(reference_token_logprobs(logits, ids, real_vocab_size=REAL_VOCAB) - old_logprobs)
            clipped += int(((ratio - 1).abs() > CLIP["clip_low"]).sum())
        (expected,) = torch.autograd.grad(total, weight)
        _close(grad, expected.float(), f"fused={fused} epochs={epochs} mini_batches={mini_batches} update {update}")
    assert clipped > 0, (stats["pg/ratio_min"], stats["pg/ratio_max"])  # the second update moved tokens out of the range
    # figures: the mean over the epochs (each covers the batch once), the extremes over every update
    assert stats["pg/clipped"] > 0 and (stats["pg/ratio_max"] > 1 + CLIP["clip_high"]
                                        or stats["pg/ratio_min"] < 1 - CLIP["clip_low"])
    assert stats["pg/ratio_min"] <= 1.0 <= stats["pg/ratio_max"]
    assert stats["pg/ratio"] != pytest.approx(stats["pg/tokens"], rel=1e-9)


def _updates_body(checkpoint: str, layout: dict):
    """``rl.ppo_epochs=2``, ``rl.mini_batches=2`` on one micro-batch per sample: the step's statistics and how far it
    moved the output layer's (last stage) and the embedding's (first stage) weights."""
    from megatron.core import parallel_state as mpu

    from megatron_gkd import parallel
    from megatron_gkd.config.schema import RLConfig
    from megatron_gkd.models import load_hf, unwrap
    from megatron_gkd.trainer.batch import build_microbatch, teacher_rows, token_coefficients
    from megatron_gkd.trainer.optim import OptimizerConfig, build_optimizer, wrap_for_training
    from megatron_gkd.trainer.policy import policy_share
    from megatron_gkd.trainer.specs import LossSpec, PolicySpec
    from megatron_gkd.trainer.step import StepRunner

    state = parallel.initialize(**layout)
    parallel.seed(0)
    optim = OptimizerConfig(optimizer="sgd", lr=10 * CLIP_LR, clip_grad=0.0)
    chunks = wrap_for_training(load_hf(checkpoint), optim)
    rl = RLConfig(combine="teacher", kd_coef=KD_COEF, aggregation="token_mean", ppo_epochs=2, mini_batches=2, **CLIP)
    config = types.SimpleNamespace(rl=rl, rollout=types.SimpleNamespace(temperature=1.0, max_tokens=8),
                                   loss=types.SimpleNamespace(fused=False, chunk_size=5))
    runner = StepRunner(chunks, build_optimizer(optim, chunks), types.SimpleNamespace(step=lambda increment: None),
                        tp_group=state.tp_group, dp_group=mpu.get_data_parallel_group_gloo(),
                        dp_size=state.data_parallel_size, is_last_stage=state.is_pipeline_last_stage,
                        policy=PolicySpec.from_config(config, REAL_VOCAB))
    samples, _, outputs = _batch()
    num_tokens = sum(s.response_len for s in samples)
    rows = teacher_rows(outputs, samples)
    coefficients = token_coefficients(samples, total_tokens=num_tokens, num_groups=NUM_GROUPS)
    share = policy_share(config, samples, None, {"teacher": (list(range(len(samples))), rows)}, {"teacher": 1.0},
                         num_tokens=num_tokens, num_sequences=len(samples))
    last = state.is_pipeline_last_stage
    microbatches = [build_microbatch([samples[i]], [coefficients[i]], policy=share.take([i]) if last else None,
                                     shape=(1, 16), version=0, sampled=(0, False) if last else None)
                    for i in range(len(samples))]
    gpt = unwrap(chunks[0])

    def weights():
        return (gpt.output_layer.weight.detach().clone() if gpt.post_process else None,
                gpt.embedding.word_embeddings.weight.detach().clone() if gpt.pre_process else None)

    before = weights()
    stats, _ = runner.train_step(LossSpec(loss_type="forward_kl", real_vocab_size=REAL_VOCAB), microbatches)
    output, embedding = (None if b is None else a - b for a, b in zip(weights(), before))
    parallel.destroy()
    return state.tp_rank, stats, output, embedding


@pytest.mark.parametrize("layout", ["pp2", pytest.param("tp2", marks=pytest.mark.slow)])
def test_several_updates_do_not_depend_on_the_layout(checkpoint, layout):
    # pi_old is recorded by a forward pass without gradients through the whole pipeline (PP) and from the logit
    # shards (TP); each later update's ratio, clip and weights then match one rank's
    (_, reference, reference_output, reference_embedding), = run_distributed(_updates_body, 1, args=(checkpoint, {}))
    assert reference["pg/clipped"] > 0 and reference["pg/ratio_max"] > 1 + CLIP["clip_high"]
    assert reference_output.abs().max() > 0 and reference_embedding.abs().max() > 0
    for tp_rank, stats, output, embedding in run_distributed(_updates_body, 2, args=(checkpoint, LAYOUTS[layout])):
        if output is not None:
            for key in ("loss", "pg/loss", "pg/clipped", "pg/ratio", "pg/ratio_max", "pg/ratio_min", "mismatch/k1"):
                assert stats[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), (layout, key)
            expected = reference_output.chunk(2)[tp_rank] if layout == "tp2" else reference_output
            _close(output, expected, f"{layout} output layer's change")
        if embedding is not None and layout != "tp2":
            _close(embedding, reference_embedding, f"{layout} embedding's change")

"""The loss and the gradients of one global batch do not depend on how it is cut: into micro-batches
(fixed size or token budget, TCAD's confidence weights over groups that span micro-batches included)
or over data-parallel ranks. A real Megatron student (TP=2, or DP=2) against the same batch in one
micro-batch on one rank."""

import numpy as np
import pytest
import torch

from megatron_gkd.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

VOCAB = 512
NUM_GROUPS, N = 3, 3  # 3 prompts x 3 samples
TOP_K, STUDENT_K = 8, 4


def _batch():
    """Samples of varied lengths, their TeacherOutputs (with requested ids) and the TCAD spec."""
    from megatron_gkd.teacher import TeacherOutput
    from megatron_gkd.trainer.batch import Sample, TCADSpec

    rng = np.random.default_rng(0)
    samples, outputs = [], []
    for group in range(NUM_GROUPS):
        prompt = rng.integers(3, VOCAB, rng.integers(2, 6)).tolist()
        for _ in range(N):
            response = rng.integers(3, VOCAB, rng.integers(1, 9)).tolist()
            topk = torch.from_numpy(rng.integers(0, VOCAB, (len(response), STUDENT_K)))
            samples.append(Sample(tokens=torch.tensor(prompt + response), prompt_len=len(prompt), group=group,
                                  prompt_index=group, student_topk=topk))
            logits = rng.normal(size=(len(response), VOCAB)) * 2
            logprobs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
            order = np.argsort(-logprobs, axis=1)[:, :TOP_K]
            outputs.append(TeacherOutput(
                topk_ids=order.astype(np.int64), topk_logprobs=np.take_along_axis(logprobs, order, 1).astype(np.float32),
                token_logprobs=logprobs[np.arange(len(response)), response].astype(np.float32),
                requested_logprobs=np.take_along_axis(logprobs, topk.numpy(), 1).astype(np.float32)))
    return samples, outputs, TCADSpec(support_k=10)


def _body(checkpoint: str, layout: dict, plans: dict):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf
    from megatron_gkd.trainer.batch import build_microbatch, teacher_rows, token_coefficients
    from megatron_gkd.trainer.optim import OptimizerConfig, build_lr_scheduler, build_optimizer, wrap_for_training
    from megatron_gkd.trainer.specs import LossSpec
    from megatron_gkd.trainer.step import StepRunner

    state = parallel.initialize(**layout)
    parallel.seed(0)
    config = OptimizerConfig(lr=1e-3)
    chunks = wrap_for_training(load_hf(checkpoint), config)
    optimizer = build_optimizer(config, chunks)
    runner = StepRunner(chunks, optimizer, build_lr_scheduler(config, optimizer, 10), tp_group=state.tp_group,
                        dp_group=mpu.get_data_parallel_group_gloo(), dp_size=state.data_parallel_size,
                        is_last_stage=state.is_pipeline_last_stage)
    samples, outputs, tcad = _batch()
    total_tokens = sum(s.response_len for s in samples)
    groups = np.array_split(np.arange(NUM_GROUPS), state.data_parallel_size)[state.dp_rank]
    mine = [i for i, s in enumerate(samples) if s.group in set(groups.tolist())]
    samples, outputs = [samples[i] for i in mine], [outputs[i] for i in mine]
    rows = teacher_rows(outputs, samples, tcad=tcad, vocab_size=VOCAB)
    coefficients = token_coefficients(samples, total_tokens=total_tokens, num_groups=NUM_GROUPS,
                                      teacher_token_logprobs=rows.token_logprobs.split([s.response_len for s in samples]),
                                      confidence_alpha=0.7)
    per_sample = rows.split([s.response_len for s in samples])
    spec = LossSpec(loss_type="tcad", options={"coverage_coef": 0.5})
    results = {}
    for name, plan in plans.items():
        indices = plan(len(samples))
        microbatches = [build_microbatch([samples[i] for i in mb], [coefficients[i] for i in mb],
                                         rows=[per_sample[i] for i in mb]) for mb in indices]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        stats = runner.run(spec, microbatches, forward_only=False)
        for chunk in chunks:  # as the optimizer would: finish the DP reduction
            chunk.finish_grad_sync()
        grads = {name: param.main_grad.clone() for name, param in chunks[0].module.named_parameters()}
        results[name] = (stats["loss"], stats["coverage"], grads, len(microbatches))
    parallel.destroy()
    return dist.get_rank(), results


def _one(n):
    return [list(range(n))]


def _singles(n):
    return [[i] for i in range(n)]


def _budget(n):
    from megatron_gkd.trainer.batch import plan_microbatches

    samples, _, _ = _batch()
    return plan_microbatches([s.input_len for s in samples][:n], max_tokens=24)


PLANS = {"one": _one, "singles": _singles, "budget": _budget}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from megatron_gkd.recipes.tiny import build_checkpoint

    return str(build_checkpoint(tmp_path_factory.mktemp("student"), vocab_size=VOCAB, seed=3))


def _close(a, b, what):
    # fp32 gradients summed in another order (embedding rows gather several positions): differences of a
    # few ulps of the largest entries; a wrong coefficient or a missing group weight is orders larger.
    torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6, msg=lambda m: f"{what}: {m}")


def test_micro_batches_do_not_change_loss_or_gradients(checkpoint):
    for rank, results in run_distributed(_body, 2, args=(checkpoint, dict(tensor_model_parallel_size=2), PLANS)):
        loss, coverage, grads, _ = results["one"]
        assert results["singles"][3] == 9 and results["budget"][3] > 2
        for name in ("singles", "budget"):
            assert results[name][0] == pytest.approx(loss, rel=1e-6), name
            assert results[name][1] == pytest.approx(coverage, rel=1e-6), name
            for param, grad in grads.items():
                _close(results[name][2][param], grad, f"rank {rank} {name} {param}")


def test_data_parallel_ranks_sum_to_the_single_rank_batch(checkpoint):
    (_, single), = run_distributed(_body, 1, args=(checkpoint, {}, {"one": _one}))
    for rank, results in run_distributed(_body, 2, args=(checkpoint, {}, {"one": _one, "singles": _singles})):
        for name in ("one", "singles"):
            assert results[name][0] == pytest.approx(single["one"][0], rel=1e-6)
            for param, grad in single["one"][2].items():
                _close(results[name][2][param], grad, f"dp rank {rank} {name} {param}")


TEACHER_HIDDEN = 24


def _hidden_batch():
    """The same samples with teacher outputs of the hidden signal, and the teacher's whole head."""
    from megatron_gkd.teacher import TeacherOutput

    samples, _, _ = _batch()
    rng = np.random.default_rng(1)
    head = torch.from_numpy(rng.normal(size=(VOCAB, TEACHER_HIDDEN)).astype(np.float32) * 0.3)
    outputs = []
    for sample in samples:
        hidden = rng.normal(size=(sample.response_len, TEACHER_HIDDEN)).astype(np.float32)
        logprobs = torch.log_softmax(torch.from_numpy(hidden) @ head.t(), -1).numpy()
        response = sample.tokens[sample.prompt_len:].numpy()
        outputs.append(TeacherOutput(topk_ids=np.zeros((len(response), 0), np.int64),
                                     topk_logprobs=np.zeros((len(response), 0), np.float32),
                                     token_logprobs=logprobs[np.arange(len(response)), response].astype(np.float32),
                                     hidden=hidden))
    return samples, outputs, head


def _hidden_body(checkpoint: str, layout: dict, loss_type: str):
    """Loss, metrics and the output-layer gradient of one hidden-signal batch, fused and unfused, in one
    micro-batch and in single-sample micro-batches."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf, unwrap
    from megatron_gkd.trainer.batch import build_microbatch, teacher_rows, token_coefficients
    from megatron_gkd.trainer.optim import OptimizerConfig, build_optimizer, wrap_for_training
    from megatron_gkd.trainer.specs import LossSpec
    from megatron_gkd.trainer.step import StepRunner

    state = parallel.initialize(**layout)
    parallel.seed(0)
    config = OptimizerConfig(lr=1e-3)
    chunks = wrap_for_training(load_hf(checkpoint), config)
    samples, outputs, head = _hidden_batch()
    tp, rank = state.config.tensor_model_parallel_size, state.tp_rank
    runner = StepRunner(chunks, build_optimizer(config, chunks), None, tp_group=state.tp_group,
                        dp_group=mpu.get_data_parallel_group_gloo(), dp_size=state.data_parallel_size,
                        is_last_stage=state.is_pipeline_last_stage,
                        teacher_heads={"teacher": head[rank * VOCAB // tp:(rank + 1) * VOCAB // tp]})
    rows = teacher_rows(outputs, samples)
    coefficients = token_coefficients(samples, total_tokens=sum(s.response_len for s in samples), num_groups=NUM_GROUPS,
                                      teacher_token_logprobs=rows.token_logprobs.split([s.response_len for s in samples]),
                                      confidence_alpha=0.7)
    per_sample = rows.split([s.response_len for s in samples])
    results = {}
    for fused in (False, True):
        spec = LossSpec(loss_type=loss_type, signal="hidden", fused=fused, chunk_size=5, teacher_temperature=1.3,
                        real_vocab_size=VOCAB - 7)
        for name, plan in (("one", _one), ("singles", _singles)):
            microbatches = [build_microbatch([samples[i] for i in mb], [coefficients[i] for i in mb],
                                             rows=[per_sample[i] for i in mb]) for mb in plan(len(samples))]
            for chunk in chunks:
                chunk.zero_grad_buffer()
            stats = runner.run(spec, microbatches, forward_only=False)
            for chunk in chunks:
                chunk.finish_grad_sync()
            output_grad = unwrap(chunks[0]).output_layer.weight.main_grad.clone()
            results[(fused, name)] = (stats, output_grad)
    parallel.destroy()
    return dist.get_rank(), results


@pytest.mark.parametrize("loss_type", ["reverse_kl", pytest.param("jsd", marks=pytest.mark.slow)])  # suite time
def test_hidden_signal_loss_is_the_same_fused_unfused_cut_and_at_tp2(checkpoint, loss_type):
    (_, single), = run_distributed(_hidden_body, 1, args=(checkpoint, {}, loss_type))
    reference_stats, reference_grad = single[(False, "one")]
    assert reference_stats["loss"] > 0 and 0 <= reference_stats["top1_agreement"] <= reference_stats["tokens"]
    assert reference_grad[VOCAB - 7:].abs().max() == 0, "padding rows got a gradient"
    for key, (stats, grad) in single.items():
        assert stats["loss"] == pytest.approx(reference_stats["loss"], rel=1e-5), key
        assert stats["teacher_entropy"] == pytest.approx(reference_stats["teacher_entropy"], rel=1e-5), key
        _close(grad, reference_grad, f"tp1 {key}")
    for rank, results in run_distributed(_hidden_body, 2, args=(checkpoint, dict(tensor_model_parallel_size=2), loss_type)):
        for key, (stats, grad) in results.items():
            assert stats["loss"] == pytest.approx(reference_stats["loss"], rel=1e-5), (rank, key)
            assert stats["student_entropy"] == pytest.approx(reference_stats["student_entropy"], rel=1e-5), (rank, key)
            _close(grad, reference_grad[rank * VOCAB // 2:(rank + 1) * VOCAB // 2], f"tp2 rank {rank} {key}")


def _mixture_body(checkpoint: str, layout: dict, weights: dict):
    """Loss and output-layer gradient with teacher ``a`` (top-k), ``b`` (hidden states) and their mixture."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf, unwrap
    from megatron_gkd.trainer.batch import TeacherShare, build_microbatch, teacher_rows, token_coefficients
    from megatron_gkd.trainer.optim import OptimizerConfig, build_optimizer, wrap_for_training
    from megatron_gkd.trainer.specs import LossSpec
    from megatron_gkd.trainer.step import StepRunner

    state = parallel.initialize(**layout)
    parallel.seed(0)
    config = OptimizerConfig(lr=1e-3)
    chunks = wrap_for_training(load_hf(checkpoint), config)
    samples, topk_outputs, _ = _batch()
    _, hidden_outputs, head = _hidden_batch()
    tp, rank = state.config.tensor_model_parallel_size, state.tp_rank
    runner = StepRunner(chunks, build_optimizer(config, chunks), None, tp_group=state.tp_group,
                        dp_group=mpu.get_data_parallel_group_gloo(), dp_size=state.data_parallel_size,
                        is_last_stage=state.is_pipeline_last_stage,
                        teacher_heads={"b": head[rank * VOCAB // tp:(rank + 1) * VOCAB // tp]})
    lengths = [s.response_len for s in samples]
    coefficients = token_coefficients(samples, total_tokens=sum(lengths), num_groups=NUM_GROUPS)
    rows = {"a": teacher_rows(topk_outputs, samples).split(lengths), "b": teacher_rows(hidden_outputs, samples).split(lengths)}
    specs = {"a": LossSpec(loss_type="jsd"), "b": LossSpec(loss_type="jsd", signal="hidden", teacher_temperature=1.3)}
    results = {}
    for name, mix in (("a", {"a": 1.0}), ("b", {"b": 1.0}), ("mixture", weights)):
        shares = [TeacherShare(t, rows[t], [c * w for c in coefficients]) for t, w in mix.items()]
        microbatches = [build_microbatch([samples[i] for i in mb], [coefficients[i] for i in mb],
                                         teachers=[share.take(mb) for share in shares]) for mb in _singles(len(samples))]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        stats = runner.run(specs, microbatches, forward_only=False)
        for chunk in chunks:
            chunk.finish_grad_sync()
        results[name] = (stats, unwrap(chunks[0]).output_layer.weight.main_grad.clone())
    parallel.destroy()
    return dist.get_rank(), results


def test_a_mixture_of_teachers_is_the_weighted_sum_of_single_teacher_runs(checkpoint):
    weights = {"a": 0.3, "b": 0.7}
    for rank, results in run_distributed(_mixture_body, 2, args=(checkpoint, dict(tensor_model_parallel_size=2), weights)):
        (a, grad_a), (b, grad_b), (mixture, grad_mixture) = results["a"], results["b"], results["mixture"]
        assert a["loss"] > 0 and b["loss"] > 0
        assert mixture["loss"] == pytest.approx(0.3 * a["loss"] + 0.7 * b["loss"], rel=1e-6)
        assert mixture["loss/a"] == pytest.approx(0.3 * a["loss"], rel=1e-6)
        assert mixture["loss/b"] == pytest.approx(0.7 * b["loss"], rel=1e-6)
        assert mixture["teacher_mass/a"] == pytest.approx(a["teacher_mass"], rel=1e-6)  # per teacher, unweighted
        assert mixture["teacher_entropy/b"] == pytest.approx(b["teacher_entropy"], rel=1e-6)
        _close(grad_mixture, 0.3 * grad_a + 0.7 * grad_b, f"rank {rank} mixture gradient")

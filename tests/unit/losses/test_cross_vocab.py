"""The cross-tokenizer loss (megatron_gkd.losses.cross_vocab.loss) at TP=1 and at a simulated TP=2: against the dense
float64 reference, against the same-tokenizer loss when W is the identity, and padding on either side."""

import numpy as np
import pytest
import torch

from megatron_gkd.losses import shard_ops
from megatron_gkd.losses.cross_vocab import loss as cross_vocab
from megatron_gkd.losses.cross_vocab.fused import fused_cross_vocab_distill_loss
from megatron_gkd.losses.cross_vocab.loss import (
    LocalPlan,
    cross_vocab_distill_loss,
    cross_vocab_loss_on_layout,
    local_pass,
)
from megatron_gkd.losses.cross_vocab.projection_map import shard_projection
from megatron_gkd.losses.registry import get_divergence
from megatron_gkd.losses.shard_ops import ShardLayout
from megatron_gkd.losses.vocab_parallel import prepare_teacher, vocab_parallel_distill_loss
from megatron_gkd.testing import xtok_tokenizers
from megatron_gkd.testing.cross_vocab import (
    LOSS_CONFIGS,
    CrossCase,
    VocabMap,
    identity_map,
    make_cases,
    reference_case,
    relative,
    run_case,
    shard,
    teacher_topk,
)
from megatron_gkd.xtok import build_projection

pytestmark = pytest.mark.usefixtures("cross_vocab_paths")

CASES = make_cases()
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.mark.parametrize("method", ["projected", "hybrid"])
@pytest.mark.parametrize("loss_type,options", LOSS_CONFIGS, ids=[name for name, _ in LOSS_CONFIGS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_every_divergence_matches_the_dense_reference(loss_type, options, method, dtype):
    for case in CASES:
        loss, grad, metrics = run_case(case, loss_type, options, dtype, method, 0, 1, None)
        expected, expected_grad = reference_case(case, loss_type, options, dtype, method)
        assert relative(loss, expected) <= TOLERANCE[dtype], case.name
        assert relative(grad, expected_grad) <= TOLERANCE[dtype], case.name
        assert grad.dtype == dtype and loss.dtype == dtype
        assert all(bool(torch.isfinite(value).all()) for value in metrics.values()), case.name


def _identity_case(generator: torch.Generator, real_vocab_size: int | None) -> CrossCase:
    vocab, num_rows, k = 40, 12, 6
    tokens = real_vocab_size or vocab
    logits = 2.0 * torch.randn(num_rows, vocab, generator=generator, dtype=torch.float64)
    ids, lp = teacher_topk(num_rows, tokens, k, generator)
    lp[::4, k // 2:] = float("-inf")  # teacher padding
    lp[5] = float("-inf")  # a fully padded row
    return CrossCase("identity", identity_map(tokens), logits, ids, lp,
                     torch.randn(num_rows, generator=generator, dtype=torch.float64), 0.8, real_vocab_size)


@pytest.mark.parametrize("method", ["projected", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("real_vocab_size", [None, 33])
def test_identity_map_equals_the_same_tokenizer_loss(dtype, method, real_vocab_size):
    case = _identity_case(torch.Generator().manual_seed(3), real_vocab_size)
    for loss_type, options in LOSS_CONFIGS:
        loss, grad, metrics = run_case(case, loss_type, options, dtype, method, 0, 1, None)
        logits = case.logits.to(dtype, copy=True).requires_grad_()
        same, same_metrics = vocab_parallel_distill_loss(
            logits, case.ids, case.logprobs, loss_type=loss_type, tp_group=None, temperature=case.temperature,
            real_vocab_size=real_vocab_size, **options)
        (same.double() * case.grad_out).sum().backward()
        assert (loss - same.detach()).abs().max().item() <= 1e-6 * max(1.0, same.abs().max().item()), loss_type
        assert (grad - logits.grad).abs().max().item() <= 1e-6 * max(1.0, logits.grad.abs().max().item()), loss_type
        for name in ("student_mass", "teacher_mass"):
            assert torch.allclose(metrics[name], same_metrics[name], rtol=1e-6, atol=1e-12), name
        assert metrics["unmapped_teacher_mass"].abs().max().item() == 0.0


def test_student_padding_rows_get_no_mass_and_no_gradient():
    case = next(case for case in CASES if case.real_vocab_size is not None)
    real = case.real_vocab_size
    for loss_type, options in LOSS_CONFIGS:
        loss, grad, _ = run_case(case, loss_type, options, torch.float64, "projected", 0, 1, None)
        assert grad[:, real:].abs().max().item() == 0.0, loss_type
        assert grad[:, :real].abs().max().item() > 0.0, loss_type
        moved = CrossCase(**{**case.__dict__, "logits": case.logits.clone()})
        moved.logits[:, real:] = -3.0 * moved.logits[:, real:] + 40.0  # anything on the padding rows
        moved_loss, _, _ = run_case(moved, loss_type, options, torch.float64, "projected", 0, 1, None)
        assert torch.equal(loss, moved_loss), loss_type


def test_teacher_padding_entries_are_ignored_whatever_their_id():
    case = next(case for case in CASES if case.name == "teacher_padding")
    padding = ~torch.isfinite(case.logprobs)
    assert padding.any() and padding.all(-1).any()
    other_ids = case.ids.clone()
    other_ids[padding] = torch.tensor([0, 39, -7, 10**6]).repeat(padding.sum().item() // 4 + 1)[: padding.sum()]
    moved = CrossCase(**{**case.__dict__, "ids": other_ids})
    for loss_type, options in LOSS_CONFIGS:
        loss, grad, _ = run_case(case, loss_type, options, torch.float64, "projected", 0, 1, None)
        moved_loss, moved_grad, _ = run_case(moved, loss_type, options, torch.float64, "projected", 0, 1, None)
        assert torch.equal(loss, moved_loss) and torch.equal(grad, moved_grad), loss_type
        fully_padded = padding.all(-1)
        assert loss[fully_padded].abs().max().item() == 0.0
        assert grad[fully_padded].abs().max().item() == 0.0


def test_teacher_ids_without_a_student_preimage_leave_the_compared_support():
    case = next(case for case in CASES if case.name == "unreachable_teacher_ids")
    reached = case.vocab_map.dense().sum(0) > 0
    unreached = ~reached[case.ids]
    assert unreached.any()
    for loss_type, options in LOSS_CONFIGS:
        _, _, metrics = run_case(case, loss_type, options, torch.float64, "projected", 0, 1, None)
        probs = case.logprobs.double().exp()
        assert torch.allclose(metrics["unmapped_teacher_mass"], (probs * unreached).sum(-1), rtol=1e-6)
        assert torch.allclose(metrics["teacher_mass"], (probs * ~unreached).sum(-1), rtol=1e-6)


def test_hybrid_compares_an_exact_match_with_that_student_token_alone():
    # Student tokens: 0 = "a" (exact -> teacher 0), 1 = "ab" -> half "a" + half "b" (teacher 0, 1), 2 = "b" (1:1,
    # not exact), 3 unmapped.
    vmap = VocabMap(np.array([0, 1, 1, 2]), np.array([0, 0, 1, 1]), np.array([1.0, 0.5, 0.5, 1.0], dtype=np.float32),
                    4, 2, np.array([True, False, False, False]))
    logits = torch.tensor([[0.3, -0.2, 1.1, 0.4]], dtype=torch.float64)
    p = torch.softmax(logits, -1)[0]
    ids, lp = torch.tensor([[0]]), torch.tensor([[-0.1]])
    expected = {"projected": p[0] + 0.5 * p[1], "hybrid": p[0]}
    for method, q0 in expected.items():
        projection = vmap.shard(0, 1, 4, method)
        _, metrics = cross_vocab_distill_loss(logits, ids, lp, projection, loss_type="forward_kl", tp_group=None)
        assert metrics["student_mass"].item() == pytest.approx(q0.item(), rel=1e-14), method
    both = torch.tensor([[0, 1]]), torch.tensor([[-0.1, -2.5]])
    projection = vmap.shard(0, 1, 4, "hybrid")
    _, metrics = cross_vocab_distill_loss(logits, *both, projection, loss_type="forward_kl", tp_group=None)
    assert metrics["student_mass"].item() == pytest.approx((p[0] + 0.5 * p[1] + p[2]).item(), rel=1e-14)


@pytest.mark.parametrize("bytes_per_entry", [4, 16, 64])
def test_entry_blocks_smaller_or_larger_than_the_gradient_chunks_give_the_reference(bytes_per_entry, monkeypatch):
    """The map entries live one block of rows at a time (at most a [c, V/tp] chunk's bytes): with 2-row gradient
    chunks and blocks of 1 to 8 rows, block edges fall inside and between the chunks."""
    monkeypatch.setattr(shard_ops, "HOST_CHUNK_ELEMENTS", 2 * 48)
    monkeypatch.setattr(cross_vocab, "_BYTES_PER_ENTRY", bytes_per_entry)
    for case in (c for c in CASES if c.name in ("random_map", "teacher_padding", "student_padding_rows")):
        teacher = prepare_teacher(case.ids, case.logprobs, case.logits.shape[0], 40, torch.float64)
        blocks = cross_vocab.entry_blocks(teacher.ids, teacher.valid, case.vocab_map.shard(0, 1, 48))
        assert len(blocks) > 1 and blocks[0][0] == 0 and blocks[-1][1] == case.logits.shape[0]
        assert all(stop == start for (_, stop), (start, _) in zip(blocks, blocks[1:]))
        for loss_type, options in LOSS_CONFIGS:
            loss, grad, _ = run_case(case, loss_type, options, torch.float64, "projected", 0, 1, None)
            expected, expected_grad = reference_case(case, loss_type, options, torch.float64, "projected")
            assert relative(loss, expected) <= 1e-12 and relative(grad, expected_grad) <= 1e-12, (case.name, loss_type)


def _simulated_tp(case: CrossCase, loss_type: str, options: dict, tp_size: int, monkeypatch):
    """Every simulated rank's loss and gradient shard in this process: the all-gather returns each rank's
    partial [N, 1+K] values, computed by the module's own functions on that rank's shard."""
    vocab_local = case.logits.shape[1] // tp_size
    layouts = [ShardLayout(None, tp_size, rank, vocab_local, case.real_vocab_size) for rank in range(tp_size)]
    projections = [case.vocab_map.shard(rank, tp_size, vocab_local) for rank in range(tp_size)]
    teacher = prepare_teacher(case.ids, case.logprobs, case.logits.shape[0], case.vocab_map.teacher_vocab_size,
                              torch.float64)

    def partials(rank: int) -> torch.Tensor:
        logits = shard(case.logits, rank, tp_size)
        plan = LocalPlan.of(teacher, projections[rank], torch.float64)
        local = local_pass(logits, teacher, projections[rank], plan, plan.blocks, case.temperature, torch.float64,
                           layouts[rank].tokens_local)
        return torch.cat([plan.local_lse.unsqueeze(1), local], dim=1)

    def gather(tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        pieces = [partials(rank) for rank in range(tp_size)]
        assert torch.equal(pieces[layout.tp_rank], tensor)
        return torch.stack(pieces)

    monkeypatch.setattr(cross_vocab, "all_gather_rows", gather)
    losses, grads = [], []
    divergence_options = get_divergence(loss_type).build_options(options)
    for rank in range(tp_size):
        logits = shard(case.logits, rank, tp_size).requires_grad_()
        loss, _ = cross_vocab_loss_on_layout(logits, case.ids, case.logprobs, projections[rank], layouts[rank],
                                             loss_type, divergence_options, case.temperature)
        (loss * case.grad_out).sum().backward()
        losses.append(loss.detach())
        grads.append(logits.grad)
    return losses, torch.cat(grads, dim=1)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_simulated_tensor_parallel_shards_combine_to_the_reference(tp_size, monkeypatch):
    """Fails when the projection's reduction over TP is dropped: in the 'preimages_on_every_shard' case every
    teacher id is reached from more than one shard."""
    for case in (c for c in CASES if c.name in ("preimages_on_every_shard", "random_map", "student_padding_rows")):
        for loss_type, options in LOSS_CONFIGS:
            losses, grad = _simulated_tp(case, loss_type, options, tp_size, monkeypatch)
            expected, expected_grad = reference_case(case, loss_type, options, torch.float64, "projected")
            for loss in losses:
                assert relative(loss, expected) <= 1e-12, (case.name, loss_type)
            assert relative(grad, expected_grad) <= 1e-12, (case.name, loss_type)


def test_refusals_name_the_problem():
    case = CASES[0]
    projection = case.vocab_map.shard(0, 1, 48)
    args = (case.logits, case.ids, case.logprobs, projection)
    with pytest.raises(ValueError, match="tcad"):
        cross_vocab_distill_loss(*args, loss_type="tcad", tp_group=None)
    with pytest.raises(ValueError, match="forward_kl"):
        cross_vocab_distill_loss(*args, loss_type="forward_kll", tp_group=None)
    with pytest.raises(ValueError, match="token_ids"):
        cross_vocab_distill_loss(*args, loss_type="forward_kl", tp_group=None, token_ids=case.ids[:, 0])
    with pytest.raises(ValueError, match="rows \\[24, 48\\)"):
        cross_vocab_distill_loss(case.logits[:, :24], case.ids, case.logprobs, case.vocab_map.shard(1, 2, 24),
                                 loss_type="forward_kl", tp_group=None)
    with pytest.raises(ValueError, match="real_vocab_size"):
        cross_vocab_distill_loss(*args, loss_type="forward_kl", tp_group=None, real_vocab_size=40)
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        cross_vocab_distill_loss(case.logits, case.ids + 40, case.logprobs, projection, loss_type="forward_kl",
                                 tp_group=None)
    vmap = case.vocab_map
    common = dict(student_vocab_size=48, teacher_vocab_size=40, tp_rank=0, tp_size=1, vocab_size_local=48)
    with pytest.raises(ValueError, match="sum to"):
        shard_projection(vmap.student_ids, vmap.teacher_ids, vmap.weights * 0.5, exact=vmap.exact, **common)
    with pytest.raises(ValueError, match="marked exact"):
        shard_projection(vmap.student_ids, vmap.teacher_ids, vmap.weights, exact=np.ones(48, dtype=bool), **common)
    with pytest.raises(ValueError, match="student_ids must lie"):
        shard_projection(vmap.student_ids + 1, vmap.teacher_ids, vmap.weights, exact=vmap.exact, **common)
    with pytest.raises(ValueError, match="method"):
        shard_projection(vmap.student_ids, vmap.teacher_ids, vmap.weights, exact=vmap.exact, method="gold", **common)


@pytest.mark.parametrize("bytes_per_entry", [4, 64])
@pytest.mark.parametrize("chunk_size", [5, 1024])
def test_fused_output_layer_equals_the_unfused_loss(chunk_size, bytes_per_entry, monkeypatch):
    """hidden @ W^T recomputed in token chunks (5 rows: blocks cut at chunk edges) against the unfused loss of the
    same logits and autograd through the output layer; fp64 to 1e-12, hidden and weight gradients."""
    monkeypatch.setattr(shard_ops, "HOST_CHUNK_ELEMENTS", 2 * 48)
    monkeypatch.setattr(cross_vocab, "_BYTES_PER_ENTRY", bytes_per_entry)
    generator = torch.Generator().manual_seed(5)
    for case in (c for c in CASES if c.name in ("random_map", "teacher_padding", "student_padding_rows")):
        hidden = torch.randn(case.logits.shape[0], 12, generator=generator, dtype=torch.float64)
        weight = torch.randn(48, 12, generator=generator, dtype=torch.float64)
        for loss_type, options in LOSS_CONFIGS:
            for method in ("projected", "hybrid"):
                projection = case.vocab_map.shard(0, 1, 48, method)
                common = dict(loss_type=loss_type, tp_group=None, temperature=case.temperature,
                              real_vocab_size=case.real_vocab_size, **options)
                h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                loss, metrics = fused_cross_vocab_distill_loss(h, w, case.ids, case.logprobs, projection,
                                                               chunk_size=chunk_size, **common)
                (loss * case.grad_out).sum().backward()
                h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                expected, expected_metrics = cross_vocab_distill_loss(h2 @ w2.t(), case.ids, case.logprobs,
                                                                      projection, **common)
                (expected * case.grad_out).sum().backward()
                label = (case.name, loss_type, method)
                assert relative(loss.detach(), expected.detach()) <= 1e-12, label
                assert relative(h.grad, h2.grad) <= 1e-12 and relative(w.grad, w2.grad) <= 1e-12, label
                if case.real_vocab_size is not None:
                    assert w.grad[case.real_vocab_size:].abs().max().item() == 0.0, label
                for name, value in metrics.items():
                    assert torch.allclose(value, expected_metrics[name], rtol=1e-12, atol=0), (label, name)


def test_bf16_logits_get_a_bf16_gradient_close_to_the_reference():
    for case in (c for c in CASES if c.name in ("random_map", "student_padding_rows")):
        for loss_type, options in LOSS_CONFIGS:
            loss, grad, _ = run_case(case, loss_type, options, torch.bfloat16, "projected", 0, 1, None)
            expected, expected_grad = reference_case(case, loss_type, options, torch.bfloat16, "projected")
            assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
            assert relative(loss, expected) <= 1e-5, (case.name, loss_type)  # computed in fp32 from bf16 inputs
            assert relative(grad, expected_grad) <= 2.0**-7, (case.name, loss_type)  # one bf16 rounding


def test_a_map_over_the_padded_table_is_accepted_when_its_padding_rows_are_empty():
    """megatron_gkd/xtok's ProjectionMap counts the output layer's rows, padding included."""
    case = next(c for c in CASES if c.real_vocab_size is not None)
    vmap, rows = case.vocab_map, case.logits.shape[1]
    padded = VocabMap(vmap.student_ids, vmap.teacher_ids, vmap.weights, rows, vmap.teacher_vocab_size,
                      np.concatenate([vmap.exact, np.zeros(rows - vmap.student_vocab_size, dtype=bool)]))
    loss, grad, _ = run_case(CrossCase(**{**case.__dict__, "vocab_map": padded}), "forward_kl", {}, torch.float64,
                             "projected", 0, 1, None)
    expected, expected_grad = reference_case(case, "forward_kl", {}, torch.float64, "projected")
    assert relative(loss, expected) <= 1e-12 and relative(grad, expected_grad) <= 1e-12
    reaching = VocabMap(np.append(vmap.student_ids, rows - 1), np.append(vmap.teacher_ids, 0),
                        np.append(vmap.weights, np.float32(1.0)), rows, vmap.teacher_vocab_size, padded.exact)
    with pytest.raises(ValueError, match=f"maps student id {rows - 1}"):
        run_case(CrossCase(**{**case.__dict__, "vocab_map": reaching}), "forward_kl", {}, torch.float64, "projected",
                 0, 1, None)


def test_the_map_builders_projection_map_feeds_the_loss():
    """megatron_gkd/xtok's build_projection (a one-digit student, a teacher with multi-digit numbers; padded table)
    through shard_projection, against the reference on the dense W of the same entries."""
    student = xtok_tokenizers.metaspace_numbers(xtok_tokenizers.generated_text(400, seed=1, exotic=False))
    teacher = xtok_tokenizers.bytelevel_digits(xtok_tokenizers.generated_text(400, seed=0))
    real = student.get_vocab_size()
    built = build_projection(student, teacher, student_vocab_size=real + 6)
    vmap = VocabMap(built.student_ids, built.teacher_ids, built.weights, built.student_vocab_size,
                    built.teacher_vocab_size, built.exact)
    generator = torch.Generator().manual_seed(11)
    ids, lp = teacher_topk(10, built.teacher_vocab_size, 8, generator)
    logits = 2.0 * torch.randn(10, real + 6, generator=generator, dtype=torch.float64)
    case = CrossCase("built", vmap, logits, ids, lp, torch.randn(10, generator=generator, dtype=torch.float64),
                     real_vocab_size=real)
    for method in ("projected", "hybrid"):
        for loss_type, options in LOSS_CONFIGS:
            loss, grad, _ = run_case(case, loss_type, options, torch.float64, method, 0, 1, None)
            expected, expected_grad = reference_case(case, loss_type, options, torch.float64, method)
            assert relative(loss, expected) <= 1e-12 and relative(grad, expected_grad) <= 1e-12, (method, loss_type)


@pytest.mark.parametrize("method", ["projected", "hybrid"])
def test_student_columns_compare_student_rows_without_the_map(method):
    """The chain rule's rows (megatron_gkd/teacher/clients/cross_request.py) hold student ids as ``V_t + s``: with the student's
    vocabulary appended as columns, a micro-batch mixing such rows with teacher-vocabulary rows gives, row by row,
    the dense reference of ``[W | I]``, and the student rows equal the same-tokenizer loss."""
    from megatron_gkd.losses.cross_vocab.projection_map import with_student_columns
    from megatron_gkd.testing.cross_vocab import random_map, reference_cross_vocab_loss

    generator = torch.Generator().manual_seed(11)
    student_vocab, teacher_vocab, real, k, rows = 24, 30, 21, 5, 10
    vocab_map = random_map(student_vocab, teacher_vocab, np.random.default_rng(2))
    keep = vocab_map.student_ids < real  # the map leaves the padding rows (>= real) empty
    vocab_map = type(vocab_map)(vocab_map.student_ids[keep], vocab_map.teacher_ids[keep], vocab_map.weights[keep],
                                student_vocab, teacher_vocab, vocab_map.exact & (np.arange(student_vocab) < real))
    logits = 2.0 * torch.randn(rows, student_vocab, generator=generator, dtype=torch.float64)
    teacher_ids, teacher_lp = teacher_topk(rows, teacher_vocab, k, generator)
    student_ids, student_lp = teacher_topk(rows, real, k, generator)
    student_half = torch.arange(rows) >= rows // 2
    ids = torch.where(student_half[:, None], student_ids + teacher_vocab, teacher_ids)
    lp = torch.where(student_half[:, None], student_lp, teacher_lp)
    grad_out = torch.randn(rows, generator=generator, dtype=torch.float64)
    dense = torch.zeros(student_vocab, teacher_vocab + student_vocab, dtype=torch.float64)
    dense[:, :teacher_vocab] = vocab_map.dense_hybrid() if method == "hybrid" else vocab_map.dense()
    dense[torch.arange(real), teacher_vocab + torch.arange(real)] = 1.0
    for loss_type, options in LOSS_CONFIGS:
        full = logits.clone().requires_grad_()
        expected = reference_cross_vocab_loss(full, dense, ids, lp, loss_type, 0.8, real_vocab_size=real, **options)
        (expected * grad_out).sum().backward()
        local = logits.clone().requires_grad_()
        projection = with_student_columns(vocab_map.shard(0, 1, student_vocab, method), real)
        loss, _ = cross_vocab_distill_loss(local, ids, lp, projection, loss_type=loss_type, tp_group=None,
                                           temperature=0.8, real_vocab_size=real, **options)
        (loss * grad_out).sum().backward()
        assert relative(loss, expected.detach()) <= 1e-12, loss_type
        assert relative(local.grad, full.grad) <= 1e-12, loss_type
        same = vocab_parallel_distill_loss(logits[student_half], student_ids[student_half],
                                           student_lp[student_half], loss_type=loss_type, tp_group=None,
                                           temperature=0.8, real_vocab_size=real, **options)[0]
        assert relative(loss.detach()[student_half], same) <= 1e-12, loss_type
    # Over TP each rank holds the columns of its own students, and padding rows stay empty.
    shards = [with_student_columns(vocab_map.shard(rank, 2, student_vocab // 2, method), real) for rank in (0, 1)]
    for rank, part in enumerate(shards):
        block = part.indptr[teacher_vocab:]
        held = torch.nonzero(block[1:] - block[:-1]).flatten()
        expected_held = torch.arange(rank * 12, min(rank * 12 + 12, real))
        assert torch.equal(held, expected_held) and part.mapped_rows_end == real


@pytest.mark.parametrize("method", ["projected", "hybrid"])
def test_slots_whose_sums_underflow_against_the_row_maximum_are_summed_again(method):
    """Half the rows put their mass on a student that no teacher id reaches, 110 nats above every other: in fp32
    exp(z - m) of the other students underflows to 0, so every slot of those rows sums to (almost) nothing relative
    to the row's maximum and would look unmapped. Those slots are summed again with their own maximum taken out,
    and the loss and gradient stay the dense reference's (the test fails without that second sum)."""
    case = CASES[0]
    unmapped = sorted(set(range(case.logits.shape[1])) - set(case.vocab_map.student_ids.tolist()))
    logits = case.logits.clone()
    logits[::2, unmapped[0]] += 110.0
    moved = CrossCase(**{**case.__dict__, "logits": logits})
    for loss_type, options in LOSS_CONFIGS:
        loss, grad, _ = run_case(moved, loss_type, options, torch.float32, method, 0, 1, None)
        expected, expected_grad = reference_case(moved, loss_type, options, torch.float32, method)
        assert torch.isfinite(loss).all(), loss_type
        assert relative(loss, expected) <= 1e-5, loss_type
        assert relative(grad, expected_grad) <= 1e-5, loss_type

"""The cross-tokenizer loss from the teacher's hidden states (megatron_gkd.losses.cross_vocab.hidden) at TP=1: against
the dense float64 reference (the teacher's full distribution as a K = V_t top-k row), against the same-tokenizer
hidden loss when W is the identity, and padding on either side. TP=2 is tests/distributed/losses/."""

import pytest
import torch

from megatron_gkd.losses import hidden_cross_vocab_distill_loss, hidden_distill_loss
from megatron_gkd.testing.cross_vocab import (
    LOSS_CONFIGS,
    HiddenCrossCase,
    identity_map,
    make_hidden_case,
    reference_hidden_case,
    relative,
    run_hidden_case,
)

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
CASES = {"plain": {}, "padding": {"real_vocab_size": 21, "teacher_real_vocab_size": 17}}


@pytest.mark.parametrize("loss_type,options", LOSS_CONFIGS, ids=[name for name, _ in LOSS_CONFIGS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case_name", list(CASES))
def test_matches_the_dense_reference(case_name, loss_type, options, dtype):
    case = make_hidden_case(1, **CASES[case_name])
    expected, expected_per_token, expected_grad = reference_hidden_case(case, loss_type, options)
    total, per_token, grad, metrics = run_hidden_case(case, loss_type, options, dtype, 0, 1, None)
    kept = case.weights != 0
    assert relative(total, expected) <= TOLERANCE[dtype]
    assert relative(per_token[kept], expected_per_token[kept]) <= TOLERANCE[dtype]
    assert relative(grad, expected_grad) <= TOLERANCE[dtype]
    assert grad.dtype == dtype and float(per_token[~kept].abs().sum()) == 0.0
    assert float(grad[~kept].abs().sum()) == 0.0  # a skipped row gets no gradient
    assert float(metrics["unmapped_teacher_mass"].max()) > 0  # the random map leaves teacher ids unreached
    mass = metrics["teacher_mass"] + metrics["unmapped_teacher_mass"]
    assert torch.allclose(mass[kept].double(), torch.ones(int(kept.sum()), dtype=torch.float64), atol=1e-5)


def test_padding_rows_get_no_mass_and_no_gradient():
    case = make_hidden_case(2, **CASES["padding"])
    # Huge logits on the padding rows of both tables: any leak of mass would move the loss.
    logits, head = case.logits.clone(), case.teacher_head.clone()
    logits[:, case.real_vocab_size:] = 50.0
    head[case.teacher_real_vocab_size:] = 30.0 * case.teacher_hidden[0]
    loud = HiddenCrossCase(case.vocab_map, logits, case.teacher_hidden, head, case.weights, case.real_vocab_size,
                           case.teacher_real_vocab_size)
    for loss_type, options in LOSS_CONFIGS:
        quiet_total, _, _, _ = run_hidden_case(case, loss_type, options, torch.float64, 0, 1, None)
        total, _, grad, _ = run_hidden_case(loud, loss_type, options, torch.float64, 0, 1, None)
        assert relative(total, quiet_total) <= 1e-12, loss_type
        assert float(grad[:, case.real_vocab_size:].abs().max()) == 0.0, loss_type


@pytest.mark.parametrize("loss_type,options", LOSS_CONFIGS, ids=[name for name, _ in LOSS_CONFIGS])
def test_identity_map_equals_the_same_tokenizer_hidden_loss(loss_type, options):
    case = make_hidden_case(4, student_vocab=20, teacher_vocab=20)
    projection = identity_map(20).shard(0, 1, 20)
    results = []
    for cross in (True, False):
        logits = case.logits.float().clone().requires_grad_()
        common = dict(loss_type=loss_type, tp_group=None, temperature=0.9, teacher_temperature=1.2, chunk_size=3,
                      **options)
        if cross:
            total, per_token, _ = hidden_cross_vocab_distill_loss(logits, case.teacher_hidden.float(),
                                                                  case.teacher_head.float(), projection,
                                                                  case.weights.float(), **common)
        else:
            total, per_token, _ = hidden_distill_loss(logits, case.teacher_hidden.float(), case.teacher_head.float(),
                                                      case.weights.float(), **common)
        total.backward()
        results.append((total.detach(), per_token, logits.grad))
    for cross, same in zip(results[0], results[1]):
        assert relative(cross, same) <= 1e-6, loss_type


def test_structured_inputs_and_refusals():
    case = make_hidden_case(5)
    projection = case.vocab_map.shard(0, 1, 24)
    logits = case.logits.view(2, 5, 24).requires_grad_()
    total, per_token, metrics = hidden_cross_vocab_distill_loss(
        logits, case.teacher_hidden.view(2, 5, -1), case.teacher_head, projection, case.weights.view(2, 5),
        loss_type="forward_kl", tp_group=None)
    assert per_token.shape == (2, 5) and metrics["student_mass"].shape == (2, 5)
    total.backward()
    assert logits.grad.shape == logits.shape
    args = (case.logits, case.teacher_hidden, case.teacher_head, projection, case.weights)
    with pytest.raises(ValueError, match="cross-tokenizer form"):
        hidden_cross_vocab_distill_loss(*args, loss_type="tcad", tp_group=None)
    with pytest.raises(ValueError, match="teacher_weight"):
        hidden_cross_vocab_distill_loss(case.logits, case.teacher_hidden, case.teacher_head[:, :3], projection,
                                        case.weights, loss_type="forward_kl", tp_group=None)
    with pytest.raises(ValueError, match="teacher ids"):
        hidden_cross_vocab_distill_loss(case.logits, case.teacher_hidden, case.teacher_head[:10], projection,
                                        case.weights, loss_type="forward_kl", tp_group=None)
    with torch.no_grad():
        hidden_cross_vocab_distill_loss(*args, loss_type="jsd", tp_group=None, beta=0.4)  # evaluation: no gradient

"""Adding a divergence is its function and its reference (issue #47): a squared Hellinger distance registered here,
in two places, is checked by the loss tests' own machinery against its float64 reference, on the top-k (unfused, at
every case of the shared cases, padding rows included) and with the tail bucket (unfused and fused), and the config
accepts it by name. Nothing else is touched: the tests' cases come from the registry."""

import pathlib

import pytest
import torch

from megatron_gkd.config import load_config
from megatron_gkd.losses import reference
from megatron_gkd.losses.dense import dense_divergence
from megatron_gkd.losses.divergences import NoOptions
from megatron_gkd.losses.registry import DIVERGENCES, SupportInputs, SupportTerms, register_divergence
from megatron_gkd.testing import losses as cases
from megatron_gkd.testing import tail_bucket as tail_cases
from megatron_gkd.testing.divergence_cases import divergence_cases
from megatron_gkd.trainer.checks import check_registered_names

CONFIG = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"


def _log_softmax_on(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    masked = values.masked_fill(~valid, float("-inf"))
    masked = torch.where(valid.any(-1, keepdim=True), masked, torch.zeros_like(masked))  # rows with nothing valid
    return torch.log_softmax(masked, -1).masked_fill(~valid, float("-inf"))


def hellinger(support: SupportInputs, options: NoOptions) -> SupportTerms:
    """``1 - sum_S sqrt(Ph Qh)``, both renormalised on ``S``; ``d/dz_j = (q_j sum_i r_i - r_j) / 2``, ``r = sqrt(p q)``."""
    del options
    log_p = _log_softmax_on(support.teacher_logprobs, support.valid)
    log_q = _log_softmax_on(support.student_logits, support.valid)
    root = ((log_p + log_q) / 2).exp()  # 0 off the support
    overlap = root.sum(-1)
    loss = torch.where(support.valid.any(-1), 1 - overlap, torch.zeros_like(overlap))
    grad = (log_q.exp() * overlap[:, None] - root) / 2
    return SupportTerms(loss=loss, grad_support=grad, lse_coef=torch.zeros_like(loss))


def hellinger_reference(forward_kl, log_p_hat, log_q_hat, valid, options):
    root = torch.where(valid, (log_p_hat + log_q_hat) / 2, torch.full_like(log_p_hat, float("-inf"))).exp()
    return 1 - root.sum(-1)


@pytest.fixture
def registered():
    register_divergence("hellinger", options=NoOptions)(hellinger)  # 1: its function
    reference.reference_divergence("hellinger")(hellinger_reference)  # 2: its reference
    yield
    DIVERGENCES.unregister("hellinger")
    reference._REFERENCES.pop("hellinger")


def test_a_new_divergence_is_checked_against_its_reference(registered, monkeypatch):
    assert ("hellinger", {}) in divergence_cases()
    results = [cases.check_case(case, "hellinger", {}, dtype, rank=0, tp_size=1, group=None)
               for case in cases.make_cases(tp_size=1) for dtype in (torch.float64, torch.float32)]
    assert cases.failures(results) == []
    monkeypatch.setattr(tail_cases, "TAIL_LOSSES", [("hellinger", {})])  # the module's list was built at import
    errors = tail_cases.tail_errors()
    assert len(errors) == len(tail_cases.real_vocab_sizes(1)) * 2 * 2
    assert tail_cases.failures(errors) == []


def test_the_reference_would_catch_a_wrong_gradient(registered):
    """The check above could fail: the same function with its gradient's sign flipped does not pass."""
    def wrong(support, options):
        terms = hellinger(support, options)
        return SupportTerms(loss=terms.loss, grad_support=-terms.grad_support, lse_coef=terms.lse_coef)

    DIVERGENCES.unregister("hellinger")
    register_divergence("hellinger", options=NoOptions)(wrong)
    results = [cases.check_case(case, "hellinger", {}, torch.float64, rank=0, tp_size=1, group=None)
               for case in cases.make_cases(tp_size=1)]
    assert cases.failures(results)


def test_the_config_accepts_it_by_name(registered):
    config = load_config(CONFIG, ["loss.type=hellinger"])
    check_registered_names(config)  # what the entry point checks before it starts anything
    assert config.loss.type == "hellinger"


def test_without_a_dense_form_the_hidden_signal_is_refused_by_name(registered):
    """``dense=`` is optional: a divergence registered without it is refused with teacher.signal=hidden, naming the
    key and the divergences that have the form."""
    with pytest.raises(ValueError, match="loss.type=hellinger has no full-vocabulary form for teacher.signal=hidden; "
                                         "use teacher.signal=topk, or loss.type=forward_kl or jsd"):
        load_config(CONFIG, ["loss.type=hellinger", "teacher.signal=hidden"])
    with pytest.raises(ValueError, match="'hellinger' has no full-vocabulary form"):
        dense_divergence("hellinger", {})

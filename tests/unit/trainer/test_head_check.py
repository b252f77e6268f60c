"""The hidden signal's head check (:mod:`megatron_gkd.trainer.head_check`) in one process, on synthetic rows whose
``token_logprobs`` are exact: the right head agrees to rounding, another head or a hidden row scaled by 1e4 is
refused with an error that names the key, the measured disagreement, the tolerance and the worst token; when a
batch is checked; the config fields' validation. The trainer's path at TP=2 with a real teacher:
``tests/distributed/trainer/test_head_check_flow.py``."""

import logging
import types

import pytest
import torch

from megatron_gkd.teacher.config import TeacherConfig
from megatron_gkd.trainer.batch import Sample, TeacherRows
from megatron_gkd.trainer.head_check import (
    HEAD_CHECK_TOKENS,
    TeacherHeadMismatch,
    check_due,
    check_teacher_head,
    head_agreement,
    sample_rows,
)

VOCAB, REAL, HIDDEN = 40, 37, 16  # the last 3 rows of the table are padding


def _problem(seed: int = 0, lengths=(5, 3, 7), temperature: float = 1.5):
    """Samples, the teacher's head ``[VOCAB, HIDDEN]`` and its rows of the samples, with exact token log-probs."""
    generator = torch.Generator().manual_seed(seed)
    head = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    head[REAL:] = 0
    samples = [Sample(tokens=torch.randint(0, REAL, (4 + length,), generator=generator), prompt_len=4, group=i,
                      prompt_index=10 + i) for i, length in enumerate(lengths)]
    hidden = torch.randn(sum(lengths), HIDDEN, generator=generator, dtype=torch.float64)
    tokens = torch.cat([s.tokens[s.prompt_len:] for s in samples])
    logprobs = torch.log_softmax(hidden @ head[:REAL].t() / temperature, dim=-1).gather(1, tokens[:, None])[:, 0]
    rows = TeacherRows(torch.zeros(len(tokens), 0, dtype=torch.int64), torch.zeros(len(tokens), 0),
                       logprobs.float(), hidden.float())
    return samples, head, rows


def _config(**overrides) -> types.SimpleNamespace:
    values = dict(signal="hidden", temperature=1.5, head_check_interval=10, head_check_tolerance=1.0,
                  head_checkpoint="/ckpt/teacher", head_source="/ckpt/teacher")
    values.update(overrides)
    return types.SimpleNamespace(**values)


def _check(rows, samples, head, config=None, key="teacher", step=0):
    return check_teacher_head(rows, samples, head, key=key, config=config or _config(), tp_group=None,
                              real_vocab_size=REAL, step=step)


@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-6), (torch.float32, 1e-5), (torch.bfloat16, 0.1)])
def test_the_right_head_agrees_in_every_dtype(dtype, bound):
    samples, head, rows = _problem()
    found = _check(rows, samples, head.to(dtype))
    assert found.num_tokens == 15 and found.num_over == 0
    assert found.max_nats < bound and found.mean_nats <= found.max_nats


def test_another_head_of_the_same_shape_is_refused_naming_the_key_the_nats_and_the_tolerance():
    samples, head, rows = _problem()
    _, other, _ = _problem(seed=1)
    with pytest.raises(TeacherHeadMismatch) as caught:
        _check(rows, samples, other, key="teachers.math", step=20)
    message = str(caught.value)
    assert message.startswith("teachers.math.head_checkpoint=/ckpt/teacher: ")
    assert "nats (mean" in message and "at step 20" in message
    assert "the check allows 1 nats (teachers.math.head_check_tolerance)" in message
    found = head_agreement(rows, torch.cat([s.tokens[4:] for s in samples]), other, tp_group=None, temperature=1.5,
                           real_vocab_size=REAL, tolerance=1.0, step=20)
    assert found.max_nats > 1.0 and found.num_over > found.num_tokens // 2  # most tokens are off


def test_a_hidden_row_scaled_by_1e4_is_refused_and_located():
    samples, head, rows = _problem()
    rows.hidden[5 + 2] *= 1e4  # response token 2 of the second sample (prompt 11): still finite
    assert torch.isfinite(rows.hidden).all()
    with pytest.raises(TeacherHeadMismatch, match="1 of 15 checked tokens past the tolerance") as caught:
        _check(rows, samples, head)
    assert caught.value.args[0].endswith("the worst is response token 2 of prompt 11)")


def test_an_unset_head_checkpoint_names_where_the_head_came_from():
    samples, head, rows = _problem()
    _, other, _ = _problem(seed=1)
    with pytest.raises(TeacherHeadMismatch, match=r"^teacher\.head_checkpoint \(unset: the head comes from /srv/t\)"):
        _check(rows, samples, other, config=_config(head_checkpoint=None, head_source="/srv/t"))


def test_a_check_samples_at_most_64_distinct_rows_the_same_on_every_rank_for_a_step():
    rows = sample_rows(1000, step=7)
    assert len(rows) == HEAD_CHECK_TOKENS == len(set(rows.tolist())) and rows.max() < 1000
    assert torch.equal(rows, sample_rows(1000, step=7)) and not torch.equal(rows, sample_rows(1000, step=8))
    assert sorted(sample_rows(10, step=0).tolist()) == list(range(10))


def test_checks_run_on_the_first_batch_and_every_interval_steps_of_the_hidden_signal():
    config = _config(head_check_interval=3)
    assert [check_due(config, step, first=False, scoring=False) for step in range(7)] == [
        True, False, False, True, False, False, True]
    assert check_due(config, 4, first=True, scoring=False) and check_due(config, -1, first=True, scoring=True)
    assert not check_due(config, 3, first=False, scoring=True)  # evaluation batches: only as the first batch
    assert not check_due(_config(head_check_interval=0), 10, first=False, scoring=False)
    assert not check_due(_config(signal="topk"), 0, first=True, scoring=False)


@pytest.mark.parametrize("field, value, message", [
    ("head_check_interval", -1, "teacher.head_check_interval=-1 must be >= 0"),
    ("head_check_tolerance", 0.0, "teacher.head_check_tolerance=0.0 must be a finite number of nats > 0"),
    ("head_check_tolerance", float("inf"), "teacher.head_check_tolerance=inf must be"),
    ("head_check_tolerance", float("nan"), "teacher.head_check_tolerance=nan must be"),
])
def test_the_config_refuses_bad_check_settings(field, value, message):
    with pytest.raises(ValueError, match=message):
        TeacherConfig(**{field: value})


def test_check_settings_are_inert_with_the_topk_signal(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_gkd.teacher.config"):
        TeacherConfig(head_check_interval=5)
    assert "teacher.head_check_interval: no effect with teacher.signal=topk" in caplog.text

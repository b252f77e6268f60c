"""Parsing of OpenAI-compatible echoed prompt log-probs (``token_id:N`` keys), fail-closed."""

import numpy as np
import pytest

from megatron_gkd.teacher.clients.openai_client import _parse_choice
from megatron_gkd.teacher.protocol.types import SequenceRequest, TeacherOutputError


def _choice(rows, sequence):
    """vLLM's echo: one ``token_id:N`` per position answered, position 0 without log-probs."""
    tokens = [f"token_id:{t}" for t in sequence.token_ids[:len(rows) + 1]]
    return {"index": 0, "logprobs": {"tokens": tokens, "top_logprobs": [None, *rows]}}


def test_parses_top_k_plus_scored_token_and_restores_minus_inf():
    sequence = SequenceRequest(token_ids=[10, 11, 12, 13], response_start=2)
    rows = [
        {"token_id:11": -3.0, "token_id:1": -0.5, "token_id:2": -1.0},  # position 1 (prompt, unused)
        {"token_id:12": -4.0, "token_id:5": -0.2, "token_id:6": -2.0},  # token 12 outside the top-2
        {"token_id:13": -0.2, "token_id:7": -9999.0},  # token 13 inside the top-2; -inf sentinel
    ]
    output = _parse_choice(_choice(rows, sequence), sequence, 2, "sequence 0").validate(2, 2)
    np.testing.assert_array_equal(output.topk_ids, [[5, 6], [13, 7]])
    np.testing.assert_array_equal(output.topk_logprobs, np.array([[-0.2, -2.0], [-0.2, -np.inf]], np.float32))
    np.testing.assert_array_equal(output.token_logprobs, np.array([-4.0, -0.2], np.float32))


@pytest.mark.parametrize("rows, match", [
    ([{"token_id:11": -1.0, "token_id:3": -0.5}], "positions"),  # last row missing
    ([{"token_id:11": -1.0, "token_id:3": -0.5}, {}], "row 1"),  # empty row
    ([{"token_id:11": -1.0, "token_id:3": -0.5}, {"token_id:4": -0.5, "token_id:5": -0.7}], "own token"),
    ([{"token_id:11": -1.0, "token_id:3": -0.5}, {"token_id:12": -0.5}], "1 top entries, expected 2"),
    ([{"tok": -1.0}, {"token_id:12": -0.5}], "token_id:N"),
])
def test_malformed_echo_fails_naming_the_sequence(rows, match):
    sequence = SequenceRequest(token_ids=[10, 11, 12], response_start=1)
    with pytest.raises(TeacherOutputError, match=f"sequence 4.*{match}"):
        _parse_choice(_choice(rows, sequence), sequence, 2, "sequence 4")

"""The hf backend scores without the logits of every position (issue #49 item 4): the decoder runs once and the
output layer sees the response rows only, a chunk at a time, and what it returns is still the float64 reference's
(top-k, requested ids, token log-probs at a temperature, a padded output table, the hidden signal). A model whose
logits are not its output layer on the last hidden state (Gemma-2's soft-capping) is found by the probe and keeps
the whole-logits forward, with the same reference."""

import numpy as np
import pytest
import torch

from megatron_gkd.teacher.backends.hf import HFBackend
from megatron_gkd.teacher.protocol.types import ScoreBatch, SequenceRequest
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher, build_tiny_teacher


@pytest.fixture(scope="module")
def padded_teacher(tmp_path_factory):
    """Output rows past the tokenizer (512 rows, 500 ids), so the chunks' slice to the tokenizer is exercised."""
    return build_tiny_teacher(tmp_path_factory.mktemp("padded"), vocab_size=512, tokenizer_size=500)


def _sequences(count=5, seed=0):
    rng = np.random.default_rng(seed)
    lengths = [9, 2, 17, 30, 12][:count]
    return [(rng.integers(3, 500, n), int(rng.integers(1, n))) for n in lengths]


def _head_rows(backend):
    """The number of rows of every call of the output layer while scoring (the calls' outputs' leading sizes)."""
    calls = []
    handle = backend._head.register_forward_hook(lambda module, args, output: calls.append(output.shape[:-1]))
    return calls, handle


@pytest.mark.parametrize("signal", ["topk", "hidden"])
def test_chunks_of_response_rows_match_the_float64_reference(padded_teacher, signal):
    backend = HFBackend(str(padded_teacher))
    assert backend._head_last
    backend._rows_per_chunk = 4  # several chunks a sequence (the 30-token one has up to 29 rows)
    rng = np.random.default_rng(1)
    sequences = [SequenceRequest(token_ids=ids, response_start=start,
                                 requested_ids=None if signal == "hidden" else rng.integers(0, 500, (len(ids) - start, 3)))
                 for ids, start in _sequences()]
    calls, handle = _head_rows(backend)
    try:
        outputs = backend.score(ScoreBatch(sequences=sequences, top_k=6, temperature=0.7, signal=signal,
                                           hidden_dtype="float32"))
    finally:
        handle.remove()
    assert calls and all(len(shape) == 1 and shape[0] <= 4 for shape in calls)  # never [b, L] positions at once
    assert sum(shape[0] for shape in calls) == sum(len(s.token_ids) - s.response_start for s in sequences)
    reference = ReferenceTeacher(padded_teacher)
    whole = HFBackend(str(padded_teacher))
    whole._head_last = False  # the whole-logits path, for the hidden states
    expected = whole.score(ScoreBatch(sequences=sequences, top_k=6, temperature=0.7, signal=signal,
                                      hidden_dtype="float32"))
    for sequence, output, other in zip(sequences, outputs, expected):
        rows = len(sequence.token_ids) - sequence.response_start
        if signal == "topk":
            reference.assert_matches(output, sequence.token_ids, sequence.response_start, 6, temperature=0.7,
                                     requested_ids=sequence.requested_ids, vocab_limit=500)
        else:
            logprobs = reference.logprobs(sequence.token_ids, sequence.response_start, 0.7, vocab_limit=500)
            np.testing.assert_allclose(output.token_logprobs,
                                       logprobs[np.arange(rows), sequence.token_ids[sequence.response_start:]],
                                       atol=1e-4, rtol=1e-5)
            np.testing.assert_array_equal(output.hidden, other.hidden)  # the same decoder output, both paths


def test_a_model_with_soft_capped_logits_keeps_the_whole_logits(tmp_path, padded_teacher):
    from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                          final_logit_softcapping=3.0, initializer_range=0.5, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0)
    Gemma2ForCausalLM(config).eval().save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(padded_teacher).save_pretrained(tmp_path)
    backend = HFBackend(str(tmp_path))
    assert not backend._head_last  # tanh(z / 3) * 3 after the output layer: the probe sees it
    reference = ReferenceTeacher(tmp_path)
    sequences = [SequenceRequest(token_ids=ids, response_start=start) for ids, start in _sequences(3)]
    outputs = backend.score(ScoreBatch(sequences=sequences, top_k=5))
    for sequence, output in zip(sequences, outputs):
        reference.assert_matches(output, sequence.token_ids, sequence.response_start, 5)

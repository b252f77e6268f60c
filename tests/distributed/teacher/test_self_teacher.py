"""The ``self`` teacher client (issue #50 item 1): the student's own chunks score the privileged prompts.

One spawn of two gloo ranks loads a tiny checkpoint as a student would train it (train mode, parameters that need
gradients) at TP=1 (two replicas) and at TP=2, and scores batches through the self client: k = 64 with TCAD's
requested ids, and k = the whole vocabulary at temperature 2 (the full distribution). The parent compares every row
with float64 transformers on the *privileged* sequence (privileged prompt + the same response ids): top-k ids
identical, log-probs within the reference's float32 tolerance, row 0 and the last included. The same rows are far from
the reference on the student's own prompt, so the prompt was replaced. The chunks stay in train mode and no gradient
is made; the hidden signal and unknown prompts are refused on every rank alike. A frozen copy of the initial weights
(``self_weights=initial``) still scores as the checkpoint after the student's weights are halved. An EMA of the
weights (``self_weights=ema``) after two more updates of the student scores as float64 transformers on the EMA's
weights replayed in float64 from the checkpoint (the updates are elementwise, so they commute with Megatron's layout).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_gkd.teacher import ScoreBatch, SequenceRequest
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher, build_tiny_teacher

pytestmark = pytest.mark.distributed

VOCAB = 512
LAYOUTS = {"tp1": {}, "tp2": dict(tensor_model_parallel_size=2)}
EMA_DECAY = 0.7  # not 0.5: a decay swapped with 1 - decay would pass there
# Elementwise updates of the student after its halving (each followed by one of the EMA), so that the float64 replay on
# the HF tensors is the ranks' on Megatron's (fused, TP-split) ones.
STUDENT_UPDATES = (lambda p: p + 0.1 * torch.sin(13 * p), lambda p: 0.9 * p - 0.01)


def _cases() -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(student prompt, privileged prompt, response length): a 1-token student prompt, a 1-token response, and a
    privileged prompt that ends with the student's (as a template ``"{context}{prompt}"`` would)."""
    rng = np.random.default_rng(7)
    cases = []
    for prompt_len, context_len, response_len in ((1, 5, 4), (6, 9, 1), (11, 3, 13)):
        prompt = rng.integers(3, VOCAB, prompt_len)
        cases.append((prompt, np.concatenate([rng.integers(3, VOCAB, context_len), prompt]), response_len))
    return cases


def _batches() -> list[ScoreBatch]:
    rng = np.random.default_rng(8)
    sequences = [(np.concatenate([prompt, rng.integers(3, VOCAB, length)]), len(prompt))
                 for prompt, _, length in _cases()]
    return [
        ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=start,
                                              requested_ids=rng.integers(0, VOCAB, (len(ids) - start, 5)))
                              for ids, start in sequences], top_k=64),
        ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=start) for ids, start in sequences],
                   top_k=VOCAB, temperature=2.0),
    ]


def _refusal(client, batch) -> str | None:
    from megatron_gkd.teacher import TeacherError

    try:
        client.score(batch)
    except TeacherError as error:
        return error.code.value
    return None


def _score_as_self(path: str) -> dict:
    """Rank body: the self client's outputs per layout, the chunks' modes and gradients after, the refusals."""
    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf
    from megatron_gkd.teacher.backends.megatron_scoring import TeacherVocab
    from megatron_gkd.teacher.clients.privileged import PrivilegedPrompts
    from megatron_gkd.teacher.clients.self_client import SelfTeacherClient
    from megatron_gkd.trainer.components import Student, frozen_initial_copy
    from megatron_gkd.trainer.ema import WeightsEMA

    prompts = PrivilegedPrompts()
    for student, privileged, _ in _cases():
        prompts.add(student, privileged)
    vocab = TeacherVocab(vocab_size=VOCAB, tokenizer_size=VOCAB, tokenizer_digest="tiny")
    results = {}
    for name, layout in LAYOUTS.items():
        state = parallel.initialize(**layout)
        chunks = load_hf(path)
        for chunk in chunks:
            chunk.train()
        with SelfTeacherClient(chunks, vocab, prompts) as client:
            results[name] = [client.score_async(batch).result(timeout=0) for batch in _batches()]
            results[name + "-info"] = client.info()
            unknown = ScoreBatch(sequences=[SequenceRequest(token_ids=[4, 4, 4, 9], response_start=3)], top_k=2)
            hidden = ScoreBatch(sequences=_batches()[1].sequences, top_k=1, signal="hidden", hidden_dtype="float32")
            results[name + "-refused"] = [_refusal(client, unknown), _refusal(client, hidden)]
        results[name + "-training"] = [m.training for chunk in chunks for m in chunk.modules()]
        results[name + "-grads"] = [p.grad is not None for chunk in chunks for p in chunk.parameters()]
        results[name + "-requires-grad"] = all(p.requires_grad for chunk in chunks for p in chunk.parameters())
        # self_weights=initial: a frozen copy of the checkpoint, which the student's updates do not move.
        student = Student(chunks=chunks, optimizer=None, lr_scheduler=None, hf_config={"vocab_size": VOCAB},
                          dtype=torch.float32, state=state, checkpoint=path)
        frozen = frozen_initial_copy(student)
        with torch.no_grad():
            for parameter in (p for chunk in chunks for p in chunk.parameters()):
                parameter.mul_(0.5)  # an "update" of the student
        with SelfTeacherClient(frozen, vocab, prompts) as initial, SelfTeacherClient(chunks, vocab, prompts) as moved:
            results[name + "-initial"] = [initial.score(batch) for batch in _batches()[:1]]
            results[name + "-moved"] = [moved.score(batch) for batch in _batches()[:1]]
        results[name + "-frozen"] = not any(p.requires_grad for chunk in frozen for p in chunk.parameters()) \
            and not any(m.training for chunk in frozen for m in chunk.modules())
        # self_weights=ema: from the checkpoint's weights, one average after each update of the (halved) student.
        ema = WeightsEMA(student, EMA_DECAY, key="teacher.ema")
        for update in STUDENT_UPDATES:
            with torch.no_grad():
                for parameter in (p for chunk in chunks for p in chunk.parameters()):
                    parameter.copy_(update(parameter))
            ema.update()
        with SelfTeacherClient(ema.chunks, vocab, prompts) as averaged:
            results[name + "-ema"] = [averaged.score(batch) for batch in _batches()[:1]]
        parallel.destroy()
    return results


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    # Two key/value heads so that TP=2 can split them.
    return build_tiny_teacher(tmp_path_factory.mktemp("self_teacher") / "student", vocab_size=VOCAB,
                              num_key_value_heads=2, seed=4)


@pytest.fixture(scope="module")
def results(student):
    return run_distributed(_score_as_self, 2, args=(str(student),), timeout=600)


def _assert_whole_distribution(reference, output, token_ids, response_start, temperature):
    """k = V: every id once, in descending order, each with its float64 log-prob (the order of float32 near-ties
    is not compared: over 512 ids some neighbours lie closer than the rounding)."""
    want = reference.logprobs(token_ids, response_start, temperature)
    rows = np.arange(len(want))[:, None]
    np.testing.assert_array_equal(np.sort(output.topk_ids, axis=1), np.broadcast_to(np.arange(VOCAB), want.shape))
    assert (np.diff(output.topk_logprobs, axis=1) <= 0).all()
    np.testing.assert_allclose(output.topk_logprobs, want[rows, output.topk_ids], atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(output.token_logprobs, want[rows[:, 0], token_ids[response_start:]], atol=1e-4,
                               rtol=1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_self_teacher_scores_are_the_model_on_the_privileged_prompt(results, student, layout):
    reference = ReferenceTeacher(student)
    for rank_results in results:  # TP=1: each replica; TP=2: every rank of the group gets the outputs
        for batch, outputs in zip(_batches(), rank_results[layout], strict=True):
            for output, sequence, (_, privileged, _) in zip(outputs, batch.sequences, _cases(), strict=True):
                response = sequence.token_ids[sequence.response_start:]
                teacher_ids = np.concatenate([privileged, response])
                if batch.top_k < VOCAB:
                    reference.assert_matches(output, teacher_ids, len(privileged), batch.top_k, batch.temperature,
                                             sequence.requested_ids)
                else:
                    _assert_whole_distribution(reference, output, teacher_ids, len(privileged), batch.temperature)
                own = reference.logprobs(sequence.token_ids, sequence.response_start, batch.temperature)
                own_tokens = own[np.arange(len(response)), response]
                assert np.abs(output.token_logprobs - own_tokens).max() > 1e-2  # the prompt was replaced
    assert results[0][layout + "-info"].signals == ["topk"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_student_is_left_as_it_was(results, layout):
    for rank_results in results:
        assert all(rank_results[layout + "-training"])  # eval mode for the teacher's forward only
        assert not any(rank_results[layout + "-grads"])  # no gradient made
        assert rank_results[layout + "-requires-grad"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_unknown_prompts_and_the_hidden_signal_are_refused_on_every_rank(results, layout):
    for rank_results in results:
        assert rank_results[layout + "-refused"] == ["bad_request", "unsupported"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_initial_weights_stay_when_the_student_moves(results, student, layout):
    """``self_weights=initial``: the frozen copy still scores as the checkpoint after the student's weights moved;
    the current weights' teacher follows the student."""
    reference = ReferenceTeacher(student)
    batch = _batches()[0]
    for rank_results in results:
        assert rank_results[layout + "-frozen"]
        for initial, moved, sequence, (_, privileged, _) in zip(rank_results[layout + "-initial"][0],
                                                                rank_results[layout + "-moved"][0], batch.sequences,
                                                                _cases(), strict=True):
            teacher_ids = np.concatenate([privileged, sequence.token_ids[sequence.response_start:]])
            reference.assert_matches(initial, teacher_ids, len(privileged), batch.top_k, batch.temperature,
                                     sequence.requested_ids)
            assert np.abs(moved.token_logprobs - initial.token_logprobs).max() > 1e-2


@pytest.fixture(scope="module")
def ema_reference(student, tmp_path_factory):
    """The EMA's weights replayed in float64 on the HF tensors, as a checkpoint for float64 transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float64)
    with torch.no_grad():
        for average in model.parameters():
            weights = 0.5 * average  # the student halved (the initial weights' test)
            for update in STUDENT_UPDATES:
                weights = update(weights)
                average.copy_(EMA_DECAY * average + (1 - EMA_DECAY) * weights)
    out = tmp_path_factory.mktemp("self_teacher_ema") / "ema"
    model.save_pretrained(out)
    return ReferenceTeacher(out)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_ema_teacher_scores_as_the_model_with_the_averaged_weights(results, student, ema_reference, layout):
    """``self_weights=ema``: the teacher's rows are the model's with the EMA replayed in float64, and differ from the
    initial weights' (so the average moved)."""
    batch = _batches()[0]
    for rank_results in results:
        for averaged, initial, sequence, (_, privileged, _) in zip(rank_results[layout + "-ema"][0],
                                                                   rank_results[layout + "-initial"][0],
                                                                   batch.sequences, _cases(), strict=True):
            teacher_ids = np.concatenate([privileged, sequence.token_ids[sequence.response_start:]])
            ema_reference.assert_matches(averaged, teacher_ids, len(privileged), batch.top_k, batch.temperature,
                                         sequence.requested_ids)
            assert np.abs(averaged.token_logprobs - initial.token_logprobs).max() > 1e-2

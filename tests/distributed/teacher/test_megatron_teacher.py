"""The ``megatron`` backend and the ``local`` client against transformers, and across layouts.

One spawn of two gloo ranks scores the same batches with the backend at TP=1 (two replicas), TP=2 and
PP=2 (rank 0 leads, rank 1 follows through the tensor broadcast of each request), TP=1 and PP=2 again in
micro-batches of at most 64 padded tokens (several micro-batches of several sequences), a padded output
table at TP=2 and a Qwen3-MoE teacher at EP=2, then with the ``local`` client at TP=2 (offload
requested: inert on cpu) and at TP=2 with sequence parallelism. The parent compares every layout with
float64 transformers (top-k ids identical, log-probs within 1e-4, every row: row 0 and the last token
included, requested ids too), TP=2 and PP=2 with TP=1, and the local client with the backend. The
hidden signal (the output layer's input) of every layout and of the local client, with and without
sequence parallelism, is compared with the hf backend's.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from megatron_gkd.teacher import ScoreBatch, SequenceRequest
from megatron_gkd.teacher.backends.forward_groups import forward_groups
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import make_tiny_checkpoint
from megatron_gkd.testing.tiny_teacher import ReferenceTeacher, build_tiny_teacher
from tests.unit.teacher.conftest import random_sequences

pytestmark = pytest.mark.distributed

VOCAB = 512
PADDED_VOCAB = VOCAB + 32  # output rows past the tokenizer: never in the top-k, no probability mass
# Micro-batches of several sequences, right-padded: by default a batch here is one micro-batch; "-micro" layouts cut
# it into several (test_micro_layouts_cut_batches_into_several), the pipeline's last one filled with an empty row.
MICRO_TOKENS = 64
LAYOUTS = {
    "tp1": {},
    "tp2": dict(tensor_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
    "tp1-micro": dict(max_batch_tokens=MICRO_TOKENS),
    "pp2-micro": dict(pipeline_model_parallel_size=2, max_batch_tokens=MICRO_TOKENS),
}


def _batches() -> list[ScoreBatch]:
    """k = 1, 64, 256 and the whole vocabulary; temperatures 0.5, 1 and 2; TCAD requested ids in one.

    The whole vocabulary is ranked at temperature 2: at 0.5 the tail's log-probs reach about -100,
    where float32 rounding (~1e-5) reorders neighbours that the reference does not count as ties.
    """
    rng = np.random.default_rng(3)
    tcad = random_sequences(5, VOCAB, seed=1)
    plain = [random_sequences(n, VOCAB, seed=seed) for n, seed in ((4, 2), (3, 4), (2, 5))]
    return [
        ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=start,
                                              requested_ids=rng.integers(0, VOCAB, (len(ids) - start, 7)))
                              for ids, start in tcad], top_k=64),
        *(ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=start) for ids, start in sequences],
                     top_k=top_k, temperature=temperature)
          for sequences, (top_k, temperature) in zip(plain, ((256, 0.5), (VOCAB, 2.0), (1, 1.0)))),
    ]


def _hidden_batches() -> list[ScoreBatch]:
    """The hidden signal in float32 (no rounding on the wire), at temperature 0.5 for the token log-probs;
    odd lengths, so that sequence parallelism pads them."""
    return [ScoreBatch(sequences=[SequenceRequest(token_ids=ids, response_start=start)
                                  for ids, start in random_sequences(5, VOCAB, seed=6)],
                       top_k=1, temperature=0.5, signal="hidden", hidden_dtype="float32")]


def _bad_batches() -> list[ScoreBatch]:
    return [ScoreBatch(sequences=[SequenceRequest(token_ids=[3, 4, 5], response_start=1)], top_k=VOCAB + 1),
            ScoreBatch(sequences=[SequenceRequest(token_ids=[3, VOCAB + 7], response_start=1)], top_k=2)]


def _refusal(backend, batch) -> str | None:
    from megatron_gkd.teacher import TeacherError

    try:
        backend.score(batch)
    except TeacherError as error:
        return error.code.value
    return None


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _score_everywhere(teacher: str, padded_teacher: str, moe_teacher: str) -> dict:
    """Rank body: outputs per layout (leader only), the padded teacher at TP=2, a MoE teacher at EP=2
    (two data-parallel ranks that both score the batch), and the local client."""
    from megatron_gkd import parallel
    from megatron_gkd.teacher.backends import build_backend
    from megatron_gkd.teacher.clients import build_client

    batches = _batches()
    results = {}
    extra = {"padded-tp2": (padded_teacher, LAYOUTS["tp2"]),
             "moe-ep2": (moe_teacher, dict(expert_model_parallel_size=2))}
    runs = [(name, teacher, layout) for name, layout in LAYOUTS.items()]
    runs += [(name, path, layout) for name, (path, layout) in extra.items()]
    for name, path, layout in runs:
        backend = build_backend("megatron", model=path, **layout)
        if backend.is_leader:
            if name == "tp2":  # refused on the leader, before the followers hear of it
                results["refused"] = [_refusal(backend, bad) for bad in _bad_batches()]
            results[name] = [backend.score(batch) for batch in batches[:1 if name in extra else None]]
            results[name + "-info"] = backend.info().to_dict()
            if name not in extra:
                results[name + "-hidden"] = [backend.score(batch) for batch in _hidden_batches()]
        else:
            backend.follow()
        backend.close()
    records = _Records()
    logging.getLogger("megatron_gkd.teacher.clients.local").addHandler(records)
    parallel.initialize(**LAYOUTS["tp2"])
    with build_client("local", model=teacher, offload=True) as client:
        # Every rank of the model-parallel group gets the outputs; score_async completes at once.
        results["local"] = [client.score_async(batch).result(timeout=0) for batch in batches]
        results["local-info"] = client.info()
        results["local-hidden"] = [client.score(batch) for batch in _hidden_batches()]
    parallel.destroy()
    # The trainer's layout may split the sequence over TP: the output layer's input is then gathered.
    parallel.initialize(**LAYOUTS["tp2"], sequence_parallel=True)
    with build_client("local", model=teacher) as client:
        results["local-sp"] = [client.score(batch) for batch in batches[:1]]
        results["local-sp-hidden"] = [client.score(batch) for batch in _hidden_batches()]
    parallel.destroy()
    results["local-warnings"] = records.messages
    return results


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_teacher")
    # Two key/value heads so that TP=2 can split them.
    dense = build_tiny_teacher(root / "dense", vocab_size=VOCAB, num_key_value_heads=2, seed=1)
    padded = build_tiny_teacher(root / "padded", vocab_size=PADDED_VOCAB, tokenizer_size=VOCAB,
                                num_key_value_heads=2, num_layers=1, seed=2)
    # Another registered architecture: the tiny Qwen3-MoE of the models tests, over this tokenizer.
    moe = build_tiny_teacher(root / "moe", vocab_size=VOCAB, num_layers=1)
    make_tiny_checkpoint("Qwen3MoeForCausalLM", moe, seed=3, vocab_size=VOCAB)
    return dense, padded, moe


@pytest.fixture(scope="module")
def reference(teachers):
    return ReferenceTeacher(teachers[0])


@pytest.fixture(scope="module")
def results(teachers):
    leader, follower = run_distributed(_score_everywhere, 2, args=tuple(map(str, teachers)), timeout=600)
    return leader, follower


def _assert_matches_reference(reference, outputs, batches, vocab_limit=None):
    for batch, batch_outputs in zip(batches, outputs, strict=True):
        for output, sequence in zip(batch_outputs, batch.sequences, strict=True):
            output.validate(sequence.num_response_tokens, batch.top_k, batch.num_requested)
            reference.assert_matches(output, sequence.token_ids, sequence.response_start, batch.top_k,
                                     batch.temperature, sequence.requested_ids, vocab_limit=vocab_limit)


def _assert_same(got, want, atol):
    for got_batch, want_batch in zip(got, want, strict=True):
        for a, b in zip(got_batch, want_batch, strict=True):
            np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
            for key in ("topk_logprobs", "token_logprobs", "requested_logprobs"):
                if getattr(b, key) is None:
                    assert getattr(a, key) is None
                else:
                    # float32 rounding grows with the log-prob's magnitude: the reference's relative
                    # part (ReferenceTeacher.assert_matches) wherever the bound is not exact.
                    np.testing.assert_allclose(getattr(a, key), getattr(b, key), atol=atol,
                                               rtol=1e-5 if atol else 0)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_megatron_backend_matches_transformers(results, reference, layout):
    leader, _ = results
    _assert_matches_reference(reference, leader[layout], _batches())
    assert leader[layout + "-info"]["supports_requested_ids"]


@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp1-micro", "pp2-micro"])
def test_parallel_layouts_equal_tp1(results, layout):
    leader, _ = results
    # Ids identical. Values may differ by float32 rounding: TP=2 sums the row-parallel matmuls in
    # another order, ~2e-5 on this teacher's wide logits; the bound is the reference tolerance.
    _assert_same(leader[layout], leader["tp1"], atol=1e-4)


def test_micro_layouts_cut_batches_into_several():
    """The "-micro" layouts score the first batch (lengths 2, 9, 20, 21, 30) in several micro-batches of several
    sequences (what MegatronScorer.micro_batches makes of it); the pipeline's in micro-batches of 2 rows, the last
    one filled with an empty row."""
    lengths = [len(sequence.token_ids) for sequence in _batches()[0].sequences]
    assert list(forward_groups(lengths, MICRO_TOKENS)) == [[0, 1, 2], [3, 4]]
    assert MICRO_TOKENS // max(lengths) == 2 and len(lengths) % 2


def test_bad_requests_are_refused_and_the_ranks_stay_in_step(results):
    leader, _ = results
    # The tp2 outputs that follow the refusals match transformers (test above), so no rank fell behind.
    assert leader["refused"] == ["unsupported", "bad_request"]


def test_padded_output_rows_are_ignored(results, teachers):
    leader, _ = results
    info = leader["padded-tp2-info"]
    assert (info["vocab_size"], info["tokenizer_size"], info["max_top_k"]) == (PADDED_VOCAB, VOCAB, VOCAB)
    outputs = leader["padded-tp2"]
    assert max(int(o.topk_ids.max()) for o in outputs[0]) < VOCAB
    _assert_matches_reference(ReferenceTeacher(teachers[1]), outputs, _batches()[:1], vocab_limit=VOCAB)


def test_moe_teacher_with_expert_parallelism_matches_transformers(results, teachers):
    leader, _ = results
    _assert_matches_reference(ReferenceTeacher(teachers[2]), leader["moe-ep2"], _batches()[:1])


def test_local_client_equals_backend_on_every_rank(results, reference):
    leader, follower = results
    _assert_same(leader["local"], leader["tp2"], atol=0)
    _assert_same(follower["local"], leader["local"], atol=0)
    _assert_matches_reference(reference, leader["local"], _batches())
    assert leader["local-info"].tokenizer_digest == leader["tp2-info"]["tokenizer_digest"]
    # offload=True is accepted and inert on cpu, with a warning.
    assert any("offload has no effect" in message for message in leader["local-warnings"])


@pytest.fixture(scope="module")
def hf_hidden(teachers):
    from megatron_gkd.teacher.backends import build_backend

    return [build_backend("hf", model=str(teachers[0])).score(batch) for batch in _hidden_batches()]


def _assert_same_hidden(got, want):
    for got_batch, want_batch, batch in zip(got, want, _hidden_batches(), strict=True):
        for a, b, sequence in zip(got_batch, want_batch, batch.sequences, strict=True):
            a.validate(sequence.num_response_tokens, batch.top_k, sequence=sequence, hidden_size=b.hidden.shape[1])
            # float32 sums in another order (row-parallel matmuls over TP): ~1e-6 of values of ~1.
            np.testing.assert_allclose(a.hidden, b.hidden, rtol=0, atol=1e-4)
            np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_megatron_hidden_equals_the_hf_backends(results, hf_hidden, layout):
    leader, _ = results
    assert leader[layout + "-info"]["signals"] == ["topk", "hidden"]
    assert leader[layout + "-info"]["hidden_size"] == hf_hidden[0][0].hidden.shape[1]
    _assert_same_hidden(leader[layout + "-hidden"], hf_hidden)


def test_local_client_hidden_with_and_without_sequence_parallelism(results, reference, hf_hidden):
    leader, follower = results
    for rank in (leader, follower):  # every rank of the model-parallel group gets the outputs
        _assert_same_hidden(rank["local-hidden"], hf_hidden)
        _assert_same_hidden(rank["local-sp-hidden"], hf_hidden)
    assert leader["local-info"].signals == ["topk", "hidden"]
    _assert_matches_reference(reference, leader["local-sp"], _batches()[:1])

"""The projection map W: identity for one tokenizer, pinned exact matches, re-tokenised rows, byte pieces,
special tokens and padding rows, save/load with its hash and tokenizer identities, and the loss's contract."""

import numpy as np
import pytest

from megatron_gkd.losses.cross_vocab.loss import shard_projection
from megatron_gkd.testing import xtok_tokenizers as toks
from megatron_gkd.xtok import ProjectionMap, build_projection, token_table


@pytest.fixture(scope="module")
def family():
    exotic, plain = toks.generated_text(800, seed=0), toks.generated_text(800, seed=1, exotic=False)
    return dict(digits=toks.bytelevel_digits(exotic), numbers=toks.metaspace_numbers(plain),
                lower=toks.wordpiece_lower(exotic), unigram=toks.unigram(exotic))


def rows_of(projection: ProjectionMap) -> dict[int, dict[int, float]]:
    out: dict[int, dict[int, float]] = {}
    for s, t, w in zip(projection.student_ids.tolist(), projection.teacher_ids.tolist(), projection.weights.tolist()):
        out.setdefault(s, {})[t] = w
    return out


def test_identical_tokenizers_give_the_identity(family):
    core = family["digits"]
    size = core.get_vocab_size()
    projection = build_projection(core, core, student_vocab_size=size + 6)
    assert projection.student_ids.tolist() == list(range(size)) == projection.teacher_ids.tolist()
    assert (projection.weights == 1).all()
    assert projection.exact[:size].all() and not projection.exact[size:].any(), "padding rows are not exact"
    assert projection.stats()["empty"] == 6 and projection.teacher_vocab_size == size


@pytest.mark.parametrize("pair", [("digits", "numbers"), ("numbers", "digits"), ("unigram", "digits"),
                                  ("digits", "lower"), ("numbers", "unigram")])
def test_rows_sum_to_one_and_exact_rows_are_pinned(family, pair):
    student_core, teacher_core = family[pair[0]], family[pair[1]]
    projection = build_projection(student_core, teacher_core, max_pieces=3)
    student, teacher = token_table(student_core), token_table(teacher_core)
    key = projection.student_ids * projection.teacher_vocab_size + projection.teacher_ids
    assert (np.diff(key) > 0).all(), "sorted by (student, teacher), no repeated pair"
    assert projection.weights.dtype == np.float32 and (projection.weights > 0).all()
    sums = np.bincount(projection.student_ids, weights=projection.weights, minlength=projection.student_vocab_size)
    mapped = np.bincount(projection.student_ids, minlength=projection.student_vocab_size)
    assert np.allclose(sums[mapped > 0], 1.0, atol=1e-6) and mapped.max() <= 3
    rows = rows_of(projection)
    teacher_pieces = {p: t for t, p in enumerate(teacher.pieces) if p and not teacher.special[t]}
    for s in range(student.vocab_size):
        if student.special[s] or not student.pieces[s]:
            continue
        if student.pieces[s] in teacher_pieces:  # a student token some teacher token writes exactly: pinned
            assert projection.exact[s] and len(rows[s]) == 1
            (t, w), = rows[s].items()
            assert teacher.pieces[t] == student.pieces[s] and w == 1.0
        else:
            assert not projection.exact[s]
            if s in rows:  # re-tokenised: the heaviest entry is the first piece, a prefix of the student's bytes
                first = max(rows[s], key=rows[s].get)
                assert student.pieces[s].startswith(teacher.pieces[first]), (student.pieces[s], teacher.pieces[first])
    assert 0 < projection.exact.sum() < student.vocab_size


def test_multi_digit_numbers_spread_over_single_digits(family):
    student, teacher = token_table(family["numbers"]), token_table(family["digits"])
    pairs = [(s, p) for s, p in enumerate(student.pieces) if len(p) == 2 and p.isdigit()]
    assert pairs, "the numbers tokenizer learnt two-digit tokens"
    digit = {bytes([c]): teacher.pieces.index(bytes([c])) for c in b"0123456789"}
    front = build_projection(family["numbers"], family["digits"])
    first_only = build_projection(family["numbers"], family["digits"], decay=0.0)
    front_rows, first_rows = rows_of(front), rows_of(first_only)
    for s, piece in pairs:
        first, second = digit[piece[:1]], digit[piece[1:]]
        want = {first: 1.0} if first == second else {first: 2 / 3, second: 1 / 3}  # decay 0.5: 1, 0.5 -> 2/3, 1/3
        assert front_rows[s] == pytest.approx(want, abs=1e-6), piece
        assert first_rows[s] == {first: 1.0}, "decay 0 keeps the first piece only"


def test_partial_characters_are_covered_by_byte_tokens(family):
    """A byte-level token holding part of an emoji (not text) maps through the teacher's byte-fallback tokens;
    a byte-fallback token maps exactly onto the byte-level token of the same byte."""
    digits, numbers = token_table(family["digits"]), token_table(family["numbers"])
    fragment = next(s for s, p in enumerate(digits.pieces) if p == b" \xf0\x9f")
    row = rows_of(build_projection(family["digits"], family["numbers"]))[fragment]
    space, f0, x9f = numbers.pieces.index(b" "), numbers.pieces.index(b"\xf0"), numbers.pieces.index(b"\x9f")
    assert row == pytest.approx({space: 4 / 7, f0: 2 / 7, x9f: 1 / 7}, abs=1e-6)
    back = build_projection(family["numbers"], family["digits"])
    assert back.exact[f0] and rows_of(back)[f0] == {digits.pieces.index(b"\xf0"): 1.0}


def test_special_tokens_and_padding_rows(family):
    digits, lower, unigram = family["digits"], family["lower"], family["unigram"]
    projection = build_projection(digits, lower, student_vocab_size=digits.get_vocab_size() + 2)
    rows = rows_of(projection)
    pad, bos, eos = (digits.token_to_id(name) for name in ("<pad>", "<s>", "</s>"))
    assert rows[eos] == {lower.token_to_id("</s>"): 1.0} and projection.exact[eos], "same content: paired"
    assert pad not in rows and bos not in rows and not projection.exact[[pad, bos]].any(), "no partner: empty"
    assert not any(s >= digits.get_vocab_size() for s in rows), "padding rows are empty"
    named = build_projection(digits, lower, special_pairs={bos: lower.token_to_id("[UNK]")})
    assert rows_of(named)[bos] == {lower.token_to_id("[UNK]"): 1.0}
    unknown = unigram.token_to_id("<unk>")
    assert unknown not in rows_of(build_projection(unigram, digits)), "the unknown token writes no known text"


def test_save_load_refuses_another_pair_and_a_corrupted_file(family, tmp_path):
    projection = build_projection(family["numbers"], family["digits"])
    path = projection.save(tmp_path / "w.npz")
    loaded = ProjectionMap.load(path, student_digest=projection.student_digest,
                                teacher_digest=projection.teacher_digest)
    for field in ("student_ids", "teacher_ids", "weights", "exact"):
        assert np.array_equal(getattr(loaded, field), getattr(projection, field))
        assert getattr(loaded, field).dtype == getattr(projection, field).dtype
    assert loaded.content_hash() == projection.content_hash()
    assert (loaded.student_vocab_size, loaded.decay) == (projection.student_vocab_size, projection.decay)
    other = token_table(family["unigram"]).digest
    with pytest.raises(ValueError, match="another teacher tokenizer"):
        ProjectionMap.load(path, teacher_digest=other)
    with pytest.raises(ValueError, match="another student tokenizer"):
        loaded.check_pair(student_digest=other, teacher_digest=projection.teacher_digest)
    with np.load(path) as data:
        arrays = {name: data[name].copy() for name in data.files}
    arrays["weights"][0] = 0.5
    with (tmp_path / "edited.npz").open("wb") as handle:
        np.savez(handle, **arrays)
    with pytest.raises(ValueError, match="content hash mismatch"):
        ProjectionMap.load(tmp_path / "edited.npz")


def test_rank_bytes_add_up(family):
    projection = build_projection(family["numbers"], family["digits"])
    per_rank = projection.rank_nbytes(2)
    entry = 8 + 8 + 4
    assert sum(per_rank) == projection.nnz * entry + 2 * -(-projection.student_vocab_size // 2)
    assert projection.rank_nbytes(1) == [projection.nnz * entry + projection.student_vocab_size]


@pytest.mark.parametrize("method", ["projected", "hybrid"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_loss_accepts_the_map(family, method, tp):
    """The contract with megatron_gkd.losses.cross_vocab.loss: every TP rank's shard builds from the COO triple (its
    checks: rows sum to 1, exact rows one entry of weight 1, ids in range)."""
    projection = build_projection(family["numbers"], family["digits"])
    local = -(-projection.student_vocab_size // tp)
    for rank in range(tp):
        shard_projection(projection.student_ids, projection.teacher_ids, projection.weights,
                         student_vocab_size=projection.student_vocab_size,
                         teacher_vocab_size=projection.teacher_vocab_size, exact=projection.exact, tp_rank=rank,
                         tp_size=tp, vocab_size_local=local, method=method)


def test_bad_arguments_are_refused(family):
    with pytest.raises(ValueError, match="max_pieces"):
        build_projection(family["digits"], family["numbers"], max_pieces=0)
    with pytest.raises(ValueError, match="decay"):
        build_projection(family["digits"], family["numbers"], decay=1.5)
    with pytest.raises(ValueError, match="smaller than the student tokenizer"):
        build_projection(family["digits"], family["numbers"], student_vocab_size=10)


def test_rows_follow_the_teachers_merges_without_its_dummy_prefix():
    """A word-internal student token ("abc") is re-tokenised by the teacher's own BPE merges (b+c before a+b:
    "a" "bc"), not by a longest-prefix match ("ab" "c") and not as a word start ("▁abc" from the pipeline's dummy
    prefix space)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    teacher = Tokenizer(models.BPE(vocab={"▁": 0, "a": 1, "b": 2, "c": 3, "bc": 4, "ab": 5, "▁a": 6},
                                   merges=[("b", "c"), ("a", "b"), ("▁", "a")]))
    teacher.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    assert teacher.encode("abc").tokens == ["▁a", "bc"], "the pipeline makes it a word start"
    student = Tokenizer(models.WordLevel(vocab={"abc": 0, "a": 1, "<unk>": 2}, unk_token="<unk>"))
    student.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    projection = build_projection(student, teacher)
    assert rows_of(projection)[0] == pytest.approx({1: 2 / 3, 4: 1 / 3}), "a (2/3), bc (1/3)"
    assert rows_of(projection)[1] == {1: 1.0} and projection.exact[1]

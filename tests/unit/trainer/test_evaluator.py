"""The eval's :class:`~megatron_gkd.trainer.eval.Evaluator` alone (#31 item 2): a fake generate and tokenizer, no
torchrun and no vLLM. It must ask for greedy answers that stop at the stop ids, score the text without the
trailing stop ids, count only records with an answer, report accuracy per group, and report the teacher KL
only when there is one."""

import dataclasses

import pytest

from megatron_gkd.config.schema import EvalConfig
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.trainer.eval import Evaluator

EOS, PAD = 2, 0
DIGITS = {10 + d: str(d) for d in range(10)} | {30: "####", EOS: "</s>"}


@dataclasses.dataclass
class Record:
    index: int
    prompt_ids: tuple
    answer: str | None
    group: str | None = None


class Tokenizer:
    def __init__(self):
        self.decoded = []

    def decode(self, ids, skip_special_tokens=False):
        self.decoded.append(list(ids))
        return " ".join(DIGITS.get(i, f"<{i}>") for i in ids if not (skip_special_tokens and i == EOS))


def ids(text: str) -> list[int]:
    lookup = {v: k for k, v in DIGITS.items()}
    return [lookup[symbol] for symbol in text.split()]


class Generate:
    """Answers each prompt with ``responses[prompt[0]]`` (the prompt's first id is its key)."""

    def __init__(self, responses: dict):
        self.responses, self.calls = responses, []

    def __call__(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        answers = [self.responses[p[0]] for p in prompts]
        return RolloutBatch.from_samples(prompts=prompts, responses=answers, logprobs=[[0.0] * len(a) for a in answers],
                                         group_ids=list(range(len(prompts))), finish_reasons=["stop"] * len(prompts),
                                         weight_version=0, pad_token_id=PAD)


RECORDS = [
    Record(0, (1, 7), "12", "add2"),  # right
    Record(1, (3, 7), "45", "add2"),  # wrong
    Record(2, (4, 7), "9", "add3"),  # right, its answer ends in stop ids that must not reach the scorer
    Record(3, (5, 7), None, "add3"),  # no answer: not scored
]
RESPONSES = {1: ids("2 1 #### 1 2") + [EOS], 3: ids("4 #### 4 4") + [EOS], 4: ids("9 #### 9") + [EOS, EOS],
             5: ids("0")}


def evaluator(kl=None, generate=None, tokenizer=None):
    config = EvalConfig(scorer="final_answer", max_tokens=7)
    return Evaluator(RECORDS, tokenizer or Tokenizer(), generate or Generate(RESPONSES), kl, config,
                     stop_token_ids=[EOS])


def test_greedy_answers_scored_per_record_and_group():
    generate, tokenizer = Generate(RESPONSES), Tokenizer()
    metrics = evaluator(generate=generate, tokenizer=tokenizer).run()
    assert metrics["eval/accuracy"] == pytest.approx(2 / 3)  # the record without an answer is not counted
    assert metrics["eval/accuracy/add2"] == pytest.approx(1 / 2)
    assert metrics["eval/accuracy/add3"] == pytest.approx(1.0)
    assert metrics["eval/num_prompts"] == 4.0
    assert metrics["eval/response_length"] == pytest.approx((6 + 5 + 5 + 1) / 4)
    assert "eval/kl_to_teacher" not in metrics
    (prompts, sampling), = generate.calls
    assert prompts == [list(r.prompt_ids) for r in RECORDS]
    assert sampling.temperature == 0.0 and sampling.max_tokens == 7 and tuple(sampling.stop_token_ids) == (EOS,)
    assert ids("9 #### 9") in tokenizer.decoded  # trailing stop ids are cut before decoding


def test_a_wrong_final_answer_is_not_counted_right():
    responses = {**RESPONSES, 1: ids("2 1 #### 1 3") + [EOS]}
    assert evaluator(generate=Generate(responses)).run()["eval/accuracy"] == pytest.approx(1 / 3)


def test_the_teacher_kl_is_measured_on_the_eval_answers():
    seen = []

    def kl(rollout, prompt_indices):
        seen.append((rollout.num_samples, prompt_indices))
        return 0.25

    assert evaluator(kl=kl).run()["eval/kl_to_teacher"] == 0.25
    assert seen == [(4, [0, 1, 2, 3])]
    assert "eval/kl_to_teacher" not in evaluator(kl=lambda rollout, indices: None).run()

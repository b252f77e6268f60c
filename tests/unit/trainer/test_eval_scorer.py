"""One implementation for eval and rewards (issue #45 item 6): ``eval.scorer`` with the ``eval`` section's options
gives every response the score the reward of the same kind and options gives it in the reward worker, on chatty
text; the eval scores the records that hold what the kind needs."""

import pytest

from megatron_gkd.config.schema import EvalConfig
from megatron_gkd.data import PromptRecord
from megatron_gkd.rewards import RewardBatch, RewardConfig, RewardFailed, RewardRunner
from megatron_gkd.rollout.types import RolloutBatch
from megatron_gkd.trainer.eval import Evaluator, Scorer

EOS = 3  # a control character: no text holds it
FUNCTIONS = "tests.unit.rewards.reward_functions"


class Tokenizer:
    """One id per character (so any text round-trips), EOS a special token."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))


def ids(text: str) -> list[int]:
    return [ord(char) for char in text]


def record(index: int, prompt: str, answer: str | None, group: str | None = None) -> PromptRecord:
    return PromptRecord(index=index, prompt_ids=tuple(ids(prompt)), response_ids=None, answer=answer, group=group)


RECORDS = [record(0, "Capital of France?", "Paris", "geo"),
           record(1, "6 x 7?", "42", "math"),
           record(2, "5 x 25?", "12", "math"),
           record(3, "Capital of Italy?", "rome", "geo"),
           record(4, "Capital of Spain?", "Madrid", "geo"),
           record(5, "Say hi.", None)]  # no answer: scored only by kinds that need none
RESPONSES = ["The capital of France is Paris.", "So the answer is **42**.", "The answer is 125. No wait, 12",
             "It is ROME, of course.", "I believe it is **Barcelona**.", "hi **there**"]
FIELDS = [{"index": r.index, "answer": r.answer, "group": r.group} for r in RECORDS]

SETTINGS = [  # (kind and options, the expected score of each response; None: not scored)
    ({"kind": "exact_match"}, [0.0, 0.0, 0.0, 0.0, 0.0, None]),
    ({"kind": "contains"}, [1.0, 1.0, 1.0, 1.0, 0.0, None]),
    ({"kind": "final_answer"}, [0.0, 0.0, 0.0, 0.0, 0.0, None]),
    ({"kind": "math_answer"}, [0.0, 0.0, 0.0, 0.0, 0.0, None]),
    ({"kind": "regex", "pattern": r"(?:is|answer is:?) {answer}"}, [1.0, 0.0, 0.0, 1.0, 0.0, None]),
    ({"kind": "regex", "pattern": r"\*\*(?P<answer>.+?)\*\*"}, [0.0, 1.0, 0.0, 0.0, 0.0, None]),
    ({"kind": "regex", "pattern": r"\*\*\w+\*\*"}, [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]),
    # the user's function reads the record too: 1 more where the response ends in the answer
    ({"kind": "function", "function": f"{FUNCTIONS}:length_bonus"}, [3.1, 2.4, 4.0, 2.2, 3.0, 1.2]),
]


def _eval_config(settings: dict) -> EvalConfig:
    options = {key: value for key, value in settings.items() if key != "kind"}
    return EvalConfig(scorer=settings["kind"], max_tokens=64, **options)


@pytest.mark.parametrize("settings, expected", SETTINGS, ids=[str(s) for s, _ in SETTINGS])
def test_the_eval_and_the_reward_give_every_response_the_same_score(settings, expected):
    scorer = Scorer(_eval_config(settings), Tokenizer(), [EOS])
    rows = [i for i, fields in enumerate(FIELDS) if scorer.scorable(fields)]
    assert rows == [i for i, value in enumerate(expected) if value is not None]
    eval_scores = scorer([RECORDS[i].prompt_ids for i in rows], [ids(RESPONSES[i]) + [EOS] for i in rows],
                         [FIELDS[i] for i in rows])
    with RewardRunner(RewardConfig(**settings)) as runner:  # the training path: the reward worker
        rewards = runner.compute(RewardBatch([Tokenizer().decode(RECORDS[i].prompt_ids) for i in rows],
                                             [RESPONSES[i] for i in rows], [FIELDS[i] for i in rows])).values
    assert eval_scores == rewards  # the same code on the same text: equal, not close
    assert rewards == pytest.approx([expected[i] for i in rows])


@pytest.mark.parametrize("settings, expected", SETTINGS, ids=[str(s) for s, _ in SETTINGS])
def test_the_evaluator_reports_the_mean_score_of_the_records_it_can_score(settings, expected):
    def generate(prompts, sampling):
        responses = [ids(RESPONSES[i]) + [EOS] for i in range(len(prompts))]
        return RolloutBatch.from_samples(prompts=prompts, responses=responses,
                                         logprobs=[[0.0] * len(r) for r in responses],
                                         group_ids=list(range(len(prompts))), finish_reasons=["stop"] * len(prompts),
                                         weight_version=0, pad_token_id=0)

    metrics = Evaluator(RECORDS, Tokenizer(), generate, None, _eval_config(settings), stop_token_ids=[EOS]).run()
    scored = [value for value in expected if value is not None]
    assert metrics["eval/accuracy"] == pytest.approx(sum(scored) / len(scored))
    assert metrics["eval/accuracy/geo"] == pytest.approx((expected[0] + expected[3] + expected[4]) / 3)


def test_an_eval_function_that_returns_no_number_is_named_as_a_reward_would_be():
    scorer = Scorer(_eval_config({"kind": "function", "function": f"{FUNCTIONS}:nan_on_second"}), Tokenizer(), [EOS])
    with pytest.raises(RewardFailed, match=r"returned nan for record 1 of 2 \(id 1"):
        scorer([RECORDS[0].prompt_ids, RECORDS[1].prompt_ids], [ids("a"), ids("b")], FIELDS[:2])

"""User reward functions for the trainer's e2e tests, imported by the reward worker as ``module:function``.

Each behaves for the run's first two batches and fails on the third call in its worker (one worker per rank
that asks the teacher), so that a run trains two steps and stops at the third.
"""

import itertools
import math
import time

_calls = itertools.count(1)


def _third() -> bool:
    return next(_calls) >= 3


def ones(prompts, responses, records):
    return [1.0] * len(responses)


def raises_on_third(prompts, responses, records):
    if _third():
        raise ValueError("the grader cannot parse this response")
    return [1.0] * len(responses)


def nan_on_third(prompts, responses, records):
    third = _third()
    return [math.nan if third and i == 1 else 0.5 for i in range(len(responses))]


def hangs_on_third(prompts, responses, records):
    if _third():
        time.sleep(3600)
    return [0.0] * len(responses)


def short_on_third(prompts, responses, records):
    return [0.0] * (len(responses) - (1 if _third() else 0))


def per_task(prompts, responses, records):
    """A verifier per task (the record's ``data.group_key`` value): task ``a`` rewards a word w10..w19, task ``b``
    a word w20..w29."""
    import re

    patterns = {"a": r"\bw1\d\b", "b": r"\bw2\d\b"}
    return [1.0 if re.search(patterns[record["group"]], response) else 0.0
            for response, record in zip(responses, records)]

"""User reward functions for the tests: the worker imports them by ``module:function`` like a user's own."""

import math
import os
import subprocess
import sys
import time

import numpy as np

from megatron_gkd.rewards.kinds import PerResponse


def length_bonus(prompts, responses, records):
    """A well-behaved batched reward: the response's length over 10, and the record's answer read."""
    return [len(response) / 10 + (1.0 if response.endswith(str(record.get("answer"))) else 0.0)
            for response, record in zip(responses, records)]


def as_numpy(prompts, responses, records):
    return np.arange(len(responses), dtype=np.float32)


def raises_on_bad(prompts, responses, records):
    """Raises for the whole batch when one response is 'bad' (like a parser that meets an odd response)."""
    return [float(int(response == "ok")) if response != "bad" else 1 / 0 for response in responses]


def raises_always(prompts, responses, records):
    raise RuntimeError("the grader service is down")


def hangs(prompts, responses, records):
    time.sleep(3600)


def hangs_in_a_child(prompts, responses, records):
    """Starts a process of its own and waits for it: a timeout must stop both."""
    with open(os.environ["REWARD_TEST_PID_FILE"], "w") as out:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        out.write(f"{os.getpid()} {child.pid}")
    child.wait()


def nan_on_second(prompts, responses, records):
    return [math.nan if i == 1 else 0.0 for i in range(len(responses))]


def inf_values(prompts, responses, records):
    return [math.inf] * len(responses)


def absurd_on_second(prompts, responses, records):
    """Finite, but past any reward's scale: GRPO's mean of two such rewards overflows."""
    return [1e308 if i == 1 else 0.0 for i in range(len(responses))]


def one_short(prompts, responses, records):
    return [0.0] * (len(responses) - 1)


def strings(prompts, responses, records):
    return ["1.0"] * len(responses)


def none_on_third(prompts, responses, records):
    return [None if i == 2 else 1.0 for i in range(len(responses))]


def a_float(prompts, responses, records):
    return 1.0


def a_generator(prompts, responses, records):
    return (1.0 for _ in responses)


def dies(prompts, responses, records):
    os._exit(3)


def prints(prompts, responses, records):
    print("a user's debug line on stdout", flush=True)
    return [1.0] * len(responses)


NOT_CALLABLE = 3


class PluginKind(PerResponse):
    """A kind a plugin registers (``REWARDS.register("name", "module:Class")``): the response's length."""

    def score(self, response, record):
        return float(len(response))


def _start_in_own_session() -> int:
    """A process in a session of its own, as code-execution graders start their sandboxes: out of the worker's
    process group, so killing that group misses it."""
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    with open(os.environ["REWARD_TEST_PID_FILE"], "w") as out:
        out.write(f"{os.getpid()} {grandchild.pid}")
    return grandchild.pid


def hangs_beside_its_own_session(prompts, responses, records):
    _start_in_own_session()
    time.sleep(3600)


def leaves_its_own_session(prompts, responses, records):
    """Returns, leaving its process running (a grader's server kept between calls)."""
    _start_in_own_session()
    return [1.0] * len(responses)

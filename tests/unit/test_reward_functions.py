"""task.reward and the one scorer (shared/scoring.py): named parts summed, a raising, wrong-typed
or too slow reward scores 0 and is counted, the driver's idle hook runs while rewards compute,
and a bad module path or signature is a one-line config error."""

from __future__ import annotations

import threading
import time

import pytest

from shared.config import load_config
from shared.errors import QerlError
from shared.rewards import format_and_correct
from shared.scoring import Scorer, training_grade
from shared.tasks import Problem
from shared.tasks.addition import AdditionTask

PROBLEM = Problem("1+2=", "3")


def _parts(problem: Problem, text: str) -> dict[str, float]:
    return {"length": -0.01 * len(text), "correct": float(text == problem.answer)}


def test_named_parts_are_summed_and_averaged():
    scorer = Scorer(_parts, threads=2)
    scores = scorer.score([PROBLEM] * 3, ["3", "44", "3"])
    scorer.close()
    assert scores.rewards == pytest.approx([0.99, -0.02, 0.99])
    assert scores.components == pytest.approx({"length": -0.04 / 3, "correct": 2 / 3})
    assert scores.errors == 0


def test_raising_and_non_numbers_score_zero_and_are_counted():
    def grade(problem, text):
        if text == "boom":
            raise RuntimeError("no")
        return {"nan": float("nan")} if text == "nan" else ("three" if text == "str" else 1.0)

    logged = []
    scorer = Scorer(grade, log=logged.append)
    scores = scorer.score([PROBLEM] * 4, ["boom", "nan", "str", "3"])
    scorer.close()
    assert scores.rewards == [0.0, 0.0, 0.0, 1.0] and scores.errors == 3 and scores.timeouts == 0
    assert len(logged) == 1 and "reward function failed on 'boom': RuntimeError: no" in logged[0]


def test_a_slow_reward_times_out_while_the_driver_keeps_pumping():
    release = threading.Event()

    def grade(problem, text):
        if text == "slow":
            release.wait(30)  # far past the limit
        return 1.0

    ticks = []
    scorer = Scorer(grade, timeout_s=0.3, threads=2, log=lambda *_: None)
    started = time.perf_counter()
    scores = scorer.score([PROBLEM] * 5, ["slow", "3", "3", "3", "3"], keep_busy=lambda: ticks.append(1))
    waited = time.perf_counter() - started
    assert scores.rewards == [0.0, 1.0, 1.0, 1.0, 1.0] and scores.errors == 1 and scores.timeouts == 1
    assert 0.3 <= waited < 5 and len(ticks) >= 10  # the driver's idle hook ran throughout
    again = scorer.score([PROBLEM] * 4, ["3"] * 4)  # a fresh thread replaced the stuck one
    assert again.rewards == [1.0] * 4 and again.errors == 0
    release.set()
    scorer.close()


def test_the_shipped_example_rewards_format_and_correctness():
    assert format_and_correct("q", "so \\boxed{\\frac{1}{2}}", "0.5") == {"format": 0.1, "correct": 1.0}
    assert format_and_correct("q", "it is 0.5", "1/2") == {"format": 0.0, "correct": 1.0}
    assert format_and_correct("q", "#### 7", "8") == {"format": 0.1, "correct": 0.0}
    config = load_config(None, ["task.reward=shared.rewards:format_and_correct"])
    grade = training_grade(AdditionTask(), config.task)
    assert grade(PROBLEM, "\\boxed{3}") == {"format": 0.1, "correct": 1.0}
    assert training_grade(AdditionTask(), load_config(None, []).task)(PROBLEM, "3") == 1.0  # the task's own


@pytest.mark.parametrize(
    "spec, message",
    [
        ("shared.rewards", "is not of the form package.module:function"),
        ("shared.no_such_module:f", "cannot import shared.no_such_module"),
        ("shared.rewards:no_such_function", "shared.rewards has no function 'no_such_function'"),
        ("shared.rewards:load_reward_function", "must take \\(prompt, completion, reference\\)"),
    ],
)
def test_a_bad_reward_is_a_one_line_config_error(spec, message):
    with pytest.raises(QerlError, match=f"task.reward: .*{message}") as error:
        load_config(None, [f"task.reward={spec}"])
    assert "\n" not in str(error.value)


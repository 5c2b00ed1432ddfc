"""task.grader "math" (HF math-verify, bounded) against today's "exact" extraction, on the jsonl
task as a run builds it: the issue's cases, GSM8K-style references, and inputs too costly to parse."""

from __future__ import annotations

import json
import time

import pytest

from shared.config import TaskConfig
from shared.errors import QerlError
from shared.tasks import build_task
from shared.tasks.jsonl import JsonlTask
from shared.tasks.math_grader import math_grade, within_bounds


def _task(tmp_path, answers: list[str], grader: str = "math") -> JsonlTask:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
    task = build_task(TaskConfig(name="jsonl", path=str(path), grader=grader))
    assert isinstance(task, JsonlTask)
    return task


@pytest.mark.parametrize(
    "reference, completion, expected",
    [
        ("\\frac{1}{2}", "so the probability is 0.5", 1.0),
        ("0.5", "The answer is \\boxed{\\frac{1}{2}}.", 1.0),
        ("\\frac{2}{3}", "2/3", 1.0),
        ("3", "Solving, x = 3", 1.0),
        ("3", "The side is \\boxed{3\\text{ cm}}", 1.0),
        ("1000", "\\boxed{1{,}000}", 1.0),
        ("1000", "they made 1,000 in total", 1.0),
        ("\\frac{2}{3}", "\\boxed{0.7}", 0.0),
        ("3", "x = 4", 0.0),
        ("1000", "no answer at all", 0.0),
    ],
)
def test_math_grader_on_the_issues_cases(reference, completion, expected):
    assert math_grade(reference, completion) == expected


def test_gsm8k_references_and_the_projects_extraction_cases(tmp_path):
    """The reference is the text after ####; the completions of the existing extraction tests
    grade as they do under "exact"."""
    task = _task(tmp_path, ["so she has 3 + 4 = 7 apples\n#### 7", "#### 1,234", "It is \\boxed{42}.",
                            "costs $12.00", "#### -5"])
    seven, thousands, boxed, dollars, negative = task.problems
    assert [p.answer for p in task.problems] == ["7", "1,234", "It is \\boxed{42}.", "costs $12.00", "-5"]
    assert task.reward(seven, "3 + 4 = 7\n#### 7") == 1.0 and task.reward(seven, "#### 8") == 0.0
    assert task.reward(thousands, "#### 1234") == 1.0
    assert task.reward(boxed, "The answer is \\boxed{42}.") == 1.0
    assert task.reward(dollars, "she pays $12.00 in total.") == 1.0
    assert task.reward(negative, "result: -5") == 1.0 and task.reward(negative, "result: 5") == 0.0
    exact = _task(tmp_path, ["#### 7"], grader="exact")
    assert exact.problems[0].answer == "7" and exact.reward(exact.problems[0], "\\boxed{7}") == 1.0
    assert exact.reward(exact.problems[0], "\\boxed{\\frac{14}{2}}") == 0.0  # what only "math" accepts
    assert task.reward(seven, "\\boxed{\\frac{14}{2}}") == 1.0


def test_a_reference_math_verify_cannot_read_is_a_one_line_error(tmp_path):
    with pytest.raises(QerlError, match="data.jsonl:2: no final answer found"):
        _task(tmp_path, ["#### 1", "none"])


@pytest.mark.parametrize(
    "completion",
    ["9" * 5000, "\\boxed{" + "{" * 500 + "5" + "}" * 500 + "}", "\\boxed{2^{2^{2^{100}}}}", "2**2**100",
     "2^2^100", "\\boxed{10^{12345}}", "12345!"],
    ids=["5000 digits", "500 nested braces", "power tower", "python power chain", "caret chain", "huge exponent",
         "factorial"],
)
def test_costly_inputs_are_refused_before_parsing(completion):
    assert not within_bounds(completion)
    started = time.perf_counter()
    assert math_grade("5", completion) == 0.0
    assert time.perf_counter() - started < 0.5


def test_ordinary_powers_and_fractions_stay_within_bounds():
    for text in ("\\boxed{x^2+y^2}", "\\boxed{(2^{10})^{3}}", "\\frac{\\frac{1}{2}}{3}", "10^{9}"):
        assert within_bounds(text), text
    assert math_grade("1073741824", "\\boxed{(2^{10})^{3}}") == 1.0


def test_working_before_a_boxed_answer_does_not_count_against_it(tmp_path):
    """MATH-style: the bounds apply to the answer (from the last \\boxed on), not the working."""
    working = "We differentiate e^{x^2} and get 2x e^{x^2}; " + "{" * 12 + "}" * 12 + " "
    task = _task(tmp_path, [working + "so the answer is $\\boxed{\\frac{3}{4}}$."])
    assert task.problems[0].answer.startswith("We differentiate")
    assert task.reward(task.problems[0], working + "Hence \\boxed{0.75}.") == 1.0
    assert task.reward(task.problems[0], working + "Hence \\boxed{0.7}.") == 0.0
    assert math_grade("5", "\\boxed{5}" + " and so on" * 1000) == 1.0  # a long tail after the answer

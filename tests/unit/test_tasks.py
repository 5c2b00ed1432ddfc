import json
from random import Random

import pytest

from shared.config import TaskConfig
from shared.errors import QerlError
from shared.tasks import Problem, build_task
from shared.tasks.addition import AdditionTask
from shared.tasks.jsonl import JsonlTask, extract_answer


def test_addition_problems_and_exact_match_reward():
    task = AdditionTask(digits=3)
    problems = task.sample(Random(0), 50)
    for problem in problems:
        a, b = problem.prompt.removesuffix("=").split("+")
        assert len(a) == len(b) == 3 and int(problem.answer) == int(a) + int(b)
    problem = Problem("12+34=", "46")
    assert task.reward(problem, "46") == 1.0
    assert task.reward(problem, " 46 ") == 1.0
    assert task.reward(problem, "47") == 0.0
    assert task.reward(problem, "46 and more") == 0.0
    assert task.sample(Random(1), 5) == task.sample(Random(1), 5)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so she has 3 + 4 = 7 apples\n#### 7", "7"),
        ("#### 1,234", "1234"),
        ("The answer is \\boxed{42}.", "42"),
        ("first 3 then \\boxed{3.50}", "3.5"),
        ("she pays $12.00 in total.", "12"),
        ("result: -5", "-5"),
        ("no digits here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def _write_jsonl(path, rows):
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")


def test_jsonl_task_reads_file_and_scores(tmp_path):
    path = tmp_path / "gsm.jsonl"
    _write_jsonl(
        path,
        [
            {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "What is 6 times 7?", "answer": "#### 42"},
            "",
        ],
    )
    task = build_task(TaskConfig(name="jsonl", path=str(path)))
    assert isinstance(task, JsonlTask) and len(task.problems) == 2
    first = task.problems[0]
    assert first.prompt == "Question: Tom has 3 apples and buys 4. How many?\nAnswer:"
    assert task.reward(first, " 3 plus 4 makes 7") == 1.0
    assert task.reward(first, "\\boxed{7}") == 1.0
    assert task.reward(first, "#### 8") == 0.0
    assert task.reward(first, "I don't know") == 0.0
    assert set(task.sample(Random(0), 20)) <= set(task.problems)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"question": "q", "answer": "#### 1"', "gsm.jsonl:2: not valid JSON"),
        ('{"question": "q"}', "gsm.jsonl:2: missing or non-text field 'answer'"),
        ('["q", "a"]', "gsm.jsonl:2: expected an object"),
        ('{"question": "q", "answer": "none"}', "gsm.jsonl:2: no final answer"),
    ],
)
def test_jsonl_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "gsm.jsonl"
    path.write_text('{"question": "fine", "answer": "#### 1"}\n' + line + "\n")
    with pytest.raises(QerlError, match=message):
        JsonlTask.from_file(path, "{question}")


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(QerlError, match="dataset file not found"):
        JsonlTask.from_file(tmp_path / "missing.jsonl", "{question}")

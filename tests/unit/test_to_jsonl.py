"""shared.tasks.to_jsonl: GSM8K- and MATH-style records to the jsonl task's file, which the task
then reads and grades."""

from __future__ import annotations

import json

import pytest

from shared.config import load_config
from shared.tasks import build_task
from shared.tasks.to_jsonl import main


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_gsm8k_and_math_records_become_task_lines(tmp_path, capsys):
    source, target = tmp_path / "raw.jsonl", tmp_path / "task.jsonl"
    _write(source, [{"question": "Tom has 3 and gets 4. How many?", "answer": "3 + 4 = 7\n#### 7", "id": 1},
                    {"problem": "What is half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "1"}])
    assert main([str(source), str(target)]) == 0
    assert "wrote 2 problems" in capsys.readouterr().out
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert lines == [{"question": "Tom has 3 and gets 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
                     {"question": "What is half of one?", "answer": "It is $\\boxed{\\frac{1}{2}}$."}]
    config = load_config(None, ["task.name=jsonl", f"task.path={target}", "task.prompt_template='{question}'"])
    task = build_task(config.task)
    gsm, math = task.problems
    assert task.reward(gsm, "so 7 in all.\n#### 7") == 1.0
    assert task.reward(math, "The answer is 0.5") == 1.0 and task.reward(math, "\\boxed{2}") == 0.0


@pytest.mark.parametrize(
    "records, args, message",
    [
        ([{"question": "q"}], [], "record 1: no 'answer' or 'solution' field"),
        (['{"question": '], [], "raw.jsonl:1: not valid JSON"),
        ([{"q": "x", "a": "#### 1"}], ["--question-field", "text"], "record 1: no 'text' field"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, records, args, message):
    source, target = tmp_path / "raw.jsonl", tmp_path / "task.jsonl"
    _write(source, records)
    assert main([str(source), str(target), *args]) == 2
    out = capsys.readouterr().out
    assert message in out and out.count("\n") == 1 and not target.exists()

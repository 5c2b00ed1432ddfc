"""A task read from a local JSONL file of {"question", "answer"} lines (GSM8K or MATH style).

task.grader "math" (the default) checks the completion's final answer for equivalence with the
reference by HF math-verify (shared/tasks/math_grader.py); the reference is the text after
`####` when there is one, else the whole answer field (math-verify finds its last \\boxed{}).
task.grader "exact": the reference and the completion both go through `extract_answer`: the text
after `####`, else the last `\\boxed{...}`, else the last number; numbers compare by value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from random import Random

from shared.errors import QerlError, read_utf8
from shared.tasks import Problem

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_answer(text: str) -> str | None:
    """The final answer in a solution or completion; None when there is none."""
    if "####" in text:
        candidate = text.rsplit("####", 1)[1].strip().splitlines()
        text_after = candidate[0] if candidate else ""
        numbers = _NUMBER.findall(text_after)
        return _normalise(numbers[0]) if numbers else (text_after.strip() or None)
    boxed = _BOXED.findall(text)
    if boxed:
        return _normalise(boxed[-1].strip())
    numbers = _NUMBER.findall(text)
    return _normalise(numbers[-1]) if numbers else None


def _normalise(answer: str) -> str:
    cleaned = answer.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return cleaned
    return str(int(value)) if value.is_integer() else repr(value)


def reference_answer(answer: str, grader: str) -> str | None:
    """What a completion is graded against; None where the answer field has no final answer."""
    if grader == "exact":
        return extract_answer(answer)
    if "####" in answer:
        lines = answer.rsplit("####", 1)[1].strip().splitlines()
        return lines[0].strip() if lines and lines[0].strip() else None
    return answer.strip() or None


@dataclass(frozen=True)
class JsonlTask:
    problems: tuple[Problem, ...]
    eval_problems: tuple[Problem, ...] = ()
    """From task.eval_path: a separate file, so training never sees them."""
    grader: str = "math"

    @classmethod
    def from_file(cls, path: str | Path, prompt_template: str, eval_path: str | Path | None = None,
                  grader: str = "math") -> JsonlTask:
        if grader == "math":
            from shared.tasks.math_grader import check_available

            check_available()
        held_out = _read_problems(Path(eval_path), prompt_template, grader) if eval_path else ()
        return cls(_read_problems(Path(path), prompt_template, grader), held_out, grader)

    def held_out(self, count: int) -> list[Problem]:
        if not self.eval_problems:
            raise QerlError("evaluating the jsonl task needs task.eval_path (a held-out JSONL file)")
        return list(self.eval_problems[:count])

    def sample(self, rng: Random, count: int) -> list[Problem]:
        """Distinct problems while the file has enough, so a step never sees one twice."""
        if count <= len(self.problems):
            return rng.sample(self.problems, count)
        return [self.problems[rng.randrange(len(self.problems))] for _ in range(count)]

    def reward(self, problem: Problem, completion: str) -> float:
        if self.grader == "math":
            from shared.tasks.math_grader import math_grade

            return math_grade(problem.answer, completion)
        predicted = extract_answer(completion)
        return 1.0 if predicted is not None and predicted == problem.answer else 0.0


def _read_problems(path: Path, prompt_template: str, grader: str) -> tuple[Problem, ...]:
    if not path.is_file():
        raise QerlError(f"dataset file not found: {path}")
    problems = []
    for number, line in enumerate(read_utf8(path).splitlines(), start=1):
        if line.strip():
            problems.append(_parse_line(path, number, line, prompt_template, grader))
    if not problems:
        raise QerlError(f"dataset {path} has no problems")
    return tuple(problems)


def _parse_line(path: Path, number: int, line: str, prompt_template: str, grader: str) -> Problem:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise QerlError(f"{where}: not valid JSON ({error.msg})") from None
    except ValueError as error:  # e.g. an integer of more than 4300 digits
        raise QerlError(f"{where}: not usable JSON ({error})") from None
    except RecursionError:
        raise QerlError(f"{where}: not usable JSON (nested too deep)") from None
    if not isinstance(record, dict):
        raise QerlError(f"{where}: expected an object with 'question' and 'answer'")
    for key in ("question", "answer"):
        if not isinstance(record.get(key), (str, int, float)):
            raise QerlError(f"{where}: missing or non-text field {key!r}")
    answer = reference_answer(str(record["answer"]), grader)
    if answer is not None and grader == "math":
        from shared.tasks.math_grader import parses

        answer = answer if parses(answer) else None
    if answer is None:
        raise QerlError(f"{where}: no final answer found in 'answer'")
    return Problem(prompt=prompt_template.format(question=record["question"]), answer=answer)

"""Tasks: where prompts come from and how a completion is scored.

A task is any object with `sample(rng, count)` and `reward(problem, completion)`; `build_task`
turns the config into one.
"""

from __future__ import annotations

from dataclasses import dataclass
from random import Random
from typing import Protocol

from shared.config import TaskConfig


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class Task(Protocol):
    def sample(self, rng: Random, count: int) -> list[Problem]: ...

    def held_out(self, count: int) -> list[Problem]:
        """Evaluation problems training never samples, the same list every call."""
        ...

    def reward(self, problem: Problem, completion: str) -> float: ...


def build_task(config: TaskConfig) -> Task:
    from shared.tasks.addition import AdditionTask
    from shared.tasks.jsonl import JsonlTask

    if config.name == "addition":
        return AdditionTask(digits=config.digits)
    assert config.path is not None  # the config validator guarantees it
    return JsonlTask.from_file(config.path, config.prompt_template, config.eval_path, config.grader)

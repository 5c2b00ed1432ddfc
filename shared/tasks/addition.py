"""The embedded task: multi-digit addition, `12+34=` -> `46`, exact-match reward."""

from __future__ import annotations

from dataclasses import dataclass
from random import Random

from shared.tasks import Problem


def make_addition_problem(rng: Random, digits: int) -> Problem:
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    return Problem(prompt=f"{a}+{b}=", answer=str(a + b))


@dataclass(frozen=True)
class AdditionTask:
    digits: int = 2

    def sample(self, rng: Random, count: int) -> list[Problem]:
        return [make_addition_problem(rng, self.digits) for _ in range(count)]

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion.strip() == problem.answer else 0.0

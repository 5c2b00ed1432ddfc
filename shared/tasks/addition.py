"""The embedded task: multi-digit addition, `12+34=` -> `46`, exact-match reward.

About a tenth of the operand pairs (chosen by a fixed hash) form the held-out split: training
never samples them, evaluation uses only them, so a rising eval accuracy is not memorisation."""

from __future__ import annotations

from dataclasses import dataclass
from random import Random

from shared.tasks import Problem

_EVAL_SEED = 20_251_013  # the held-out set is the same for every run


def is_held_out(a: int, b: int) -> bool:
    return (a * 2_654_435_761 + b * 40_503) % 1_000 < 100


def _operands(rng: Random, digits: int) -> tuple[int, int]:
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    return rng.randint(low, high), rng.randint(low, high)


def _problem(a: int, b: int) -> Problem:
    return Problem(prompt=f"{a}+{b}=", answer=str(a + b))


def make_addition_problem(rng: Random, digits: int) -> Problem:
    """A training problem (never one of the held-out pairs)."""
    while True:
        a, b = _operands(rng, digits)
        if not is_held_out(a, b):
            return _problem(a, b)


@dataclass(frozen=True)
class AdditionTask:
    digits: int = 2

    def sample(self, rng: Random, count: int) -> list[Problem]:
        return [make_addition_problem(rng, self.digits) for _ in range(count)]

    def held_out(self, count: int) -> list[Problem]:
        """The first `count` distinct held-out problems in a fixed order."""
        rng, seen, problems = Random(_EVAL_SEED), set(), []
        pairs = (10**self.digits) ** 2
        for _ in range(200 * pairs):  # bounded: 1-digit addition has only ~10 held-out pairs
            if len(problems) == count:
                break
            a, b = _operands(rng, self.digits)
            if is_held_out(a, b) and (a, b) not in seen:
                seen.add((a, b))
                problems.append(_problem(a, b))
        return problems

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion.strip() == problem.answer else 0.0

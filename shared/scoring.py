"""The one scorer: completions to rewards, for training and evaluation alike.

Scoring runs in a few daemon threads beside the driver, which meanwhile keeps the rollout queue
moving (`keep_busy`, e.g. `RolloutPool.pump_once`), so a slow reward does not leave workers idle.
One error policy: a call that raises, returns something that is not a number (or a dict of
numbers), or runs past `timeout_s` scores its sample 0 and is counted in `Scores.errors`. A call
past its time cannot be stopped (Python threads cannot be killed): its thread is abandoned
(it ends when the call returns) and a fresh one takes its place.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.config import TaskConfig
from shared.tasks import Problem, Task

Grade = Callable[[Problem, str], "float | dict[str, float]"]
_TICK_S = 0.01  # how often the waiting driver checks deadlines and pumps the rollout queue


@dataclass
class Scores:
    rewards: list[float]
    """One per completion; 0 where the call failed or timed out."""
    errors: int = 0
    timeouts: int = 0
    """Of the errors, how many ran past the time limit."""
    components: dict[str, float] = field(default_factory=dict)
    """Mean of each named part over the scored completions (a dict-returning reward)."""


def training_grade(task: Task, config: TaskConfig) -> Grade:
    """task.reward when set, else the task's own grade."""
    if config.reward is None:
        return task.reward
    from shared.rewards import load_reward_function

    function = load_reward_function(config.reward)
    return lambda problem, text: function(problem.prompt, text, problem.answer)


def _as_parts(value) -> dict[str, float]:
    parts = value if isinstance(value, dict) else {"": value}
    checked = {}
    for name, part in parts.items():
        if not isinstance(part, (int, float)) or not math.isfinite(part):
            raise TypeError(f"reward {name or 'value'} is {part!r}, not a finite number")
        checked[str(name)] = float(part)
    return checked


class Scorer:
    def __init__(self, grade: Grade, timeout_s: float = 10.0, threads: int = 4, log=print):
        self.grade, self.timeout_s, self.log = grade, timeout_s, log
        self._jobs: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._running: dict[int, tuple[tuple[int, int], float]] = {}  # thread -> (job key, start)
        self._abandoned: set[int] = set()
        self._batch = 0
        self._threads = threads
        for _ in range(threads):
            self._start_thread()

    def _start_thread(self) -> None:
        threading.Thread(target=self._serve, daemon=True, name="qerl-scorer").start()

    def _serve(self) -> None:
        me = threading.get_ident()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            key, problem, text = job
            self._running[me] = (key, time.monotonic())
            try:
                outcome = _as_parts(self.grade(problem, text))
            except Exception as error:  # one bad sample must not end a week-long run
                outcome = error
            self._running.pop(me, None)
            if me in self._abandoned:  # timed out: a replacement thread already serves
                self._abandoned.discard(me)
                return
            self._results.put((key, outcome))

    def score(self, problems: list[Problem], texts: list[str], keep_busy: Callable[[], None] | None = None) -> Scores:
        """Rewards of `texts[i]` as an answer to `problems[i]`; `keep_busy` runs while waiting."""
        self._batch += 1
        for index, (problem, text) in enumerate(zip(problems, texts)):
            self._jobs.put(((self._batch, index), problem, text))
        outcomes: dict[int, dict[str, float] | BaseException] = {}
        timeouts, last_tick = 0, time.monotonic()
        while len(outcomes) < len(texts):
            try:
                key, outcome = self._results.get(timeout=_TICK_S)
                if key[0] == self._batch:
                    outcomes.setdefault(key[1], outcome)
            except queue.Empty:
                pass
            if time.monotonic() - last_tick >= _TICK_S or len(outcomes) == len(texts):
                last_tick = time.monotonic()
                timeouts += self._time_out_overdue(outcomes)
                if keep_busy is not None:  # at most every tick: a fast reward is not slowed by it
                    keep_busy()
        return self._tally(texts, outcomes, timeouts)

    def _time_out_overdue(self, outcomes: dict) -> int:
        now, late = time.monotonic(), 0
        for thread, (key, started) in list(self._running.items()):
            if key[0] == self._batch and now - started > self.timeout_s and key[1] not in outcomes:
                self._abandoned.add(thread)
                self._running.pop(thread, None)
                outcomes[key[1]] = TimeoutError(f"took more than task.reward_timeout_s={self.timeout_s:g} s")
                self._start_thread()
                late += 1
        return late

    def _tally(self, texts: list[str], outcomes: dict, timeouts: int) -> Scores:
        scores = Scores([0.0] * len(texts), timeouts=timeouts)
        sums: dict[str, float] = {}
        for index, outcome in sorted(outcomes.items()):
            if isinstance(outcome, BaseException):
                if scores.errors == 0:
                    self.log(f"[qerl] reward function failed on {texts[index][:200]!r}: {type(outcome).__name__}: "
                             f"{outcome} (scored 0)")
                scores.errors += 1
                continue
            scores.rewards[index] = sum(outcome.values())
            for name, value in outcome.items():
                if name:
                    sums[name] = sums.get(name, 0.0) + value
        scores.components = {name: total / len(texts) for name, total in sums.items()}
        return scores

    def close(self) -> None:
        for _ in range(self._threads):
            self._jobs.put(None)

"""A week-long run's safety in the driver's own logic, without Ray or vLLM: a step with nothing to
train, run-folder lock, overwrite that keeps the previous run until the new one has proved
itself, resume inputs that are checked before anything starts. The Ray/vLLM parts these
decisions drive keep their own tests (test_resume, test_training)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from deploy.rollouts import Group, score
from deploy.train import sync
from shared.config import load_config
from shared.metrics import format_step_line
from shared.tasks import Problem
from shared.types import Completion


@dataclass
class _PoolStandIn:
    """The rollout pool as `sync` sees it: which adapter version the workers hold, and pushes."""

    state: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(adapter_version=0))
    pushed: list[int] = field(default_factory=list)

    def update_adapter(self, update, version=None, wait=True) -> list[float]:
        self.pushed.append(version)
        self.state.adapter_version = version
        return [1.0]

    def load_times(self) -> list[float]:
        return [1.0]


class _LearnerStandIn:
    class export_adapter:  # noqa: N801 - mirrors a Ray actor method handle
        @staticmethod
        def remote():
            return "adapter"


def test_a_step_that_did_not_change_the_adapter_pushes_nothing():
    """Step 0 with nothing to train (or a skipped non-finite step) leaves the learner at version 0:
    pushing it made vLLM refuse lora id 0 and killed the run."""
    pool = _PoolStandIn()
    run = SimpleNamespace(pool=pool, learner=_LearnerStandIn(), config=load_config("configs/tiny_cpu.yaml"))
    assert sync(run, 0) == {"sync/adapter_ms": 0.0, "sync/worker_load_ms_max": 0.0}
    sync(run, 1)
    sync(run, 1)  # the next step trained nothing either
    assert pool.pushed == [1]


def test_the_step_line_of_a_step_with_nothing_to_train():
    record = {"step": 3, "rollout/reward_mean": 1.0, "rollout/accuracy": 1.0, "aqn/sigma": 0.0,
              "rollout/tok_per_s": 10.0, "sync/adapter_ms": 0.0, "time/step_s": 0.1}
    assert "nothing to train" in format_step_line(record)
    assert "entropy 0.500" in format_step_line(record | {"learner/entropy": 0.5, "mismatch/kl": 0.0})


def test_a_nan_reward_scores_zero_and_is_counted():
    class NanTask:
        def reward(self, problem, completion):
            return math.nan if completion == "nan" else 1.0

    def decode(ids, skip_special_tokens):
        return ["nan" if i == [1] else "ok" for i in ids]

    tokenizer = SimpleNamespace(batch_decode=decode)
    run = SimpleNamespace(config=load_config("configs/tiny_cpu.yaml"), tokenizer=tokenizer, task=NanTask())
    completions = [Completion(0, [token], [0.0], "stop", 1, 0.0, 0) for token in (1, 2)]
    group = Group(Problem("1+1=", "2"), [5], completions)
    assert score(run, [group]) == 1
    assert group.rewards == [0.0, 1.0]

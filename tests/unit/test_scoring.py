"""The driver's scoring step on real completions and the real tokenizer: a reward function that
raises scores that sample 0 and is counted; DAPO's overlong penalty and dynamic-sampling filter."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from deploy.rollouts import Group, informative, score, training_samples
from shared.config import load_config
from shared.scoring import Scorer
from shared.tasks import Problem
from shared.tasks.addition import AdditionTask
from shared.tiny_model import build_tokenizer
from shared.types import Completion


@dataclass(frozen=True)
class FlakyAddition(AdditionTask):
    """Addition whose reward function breaks on completions containing '9'."""

    def reward(self, problem: Problem, completion: str) -> float:
        if "9" in completion:
            raise ValueError("cannot parse")
        return super().reward(problem, completion)


def _group(tokenizer, problem: Problem, texts: list[str]) -> Group:
    completions = [Completion(0, tokenizer(t, add_special_tokens=False)["input_ids"], [], "stop", 0, 0.0, 0)
                   for t in texts]
    return Group(problem, [], completions)


def _run(task, overrides=()):
    config = load_config(None, ["rollout.max_new_tokens=4", *overrides])
    # no fleet here: nothing for the scorer's wait to keep moving
    return SimpleNamespace(config=config, tokenizer=build_tokenizer(), task=task, scorer=Scorer(task.reward),
                           pool=SimpleNamespace(pump_once=lambda: None))


def test_a_raising_reward_scores_zero_and_is_counted(capsys):
    run = _run(FlakyAddition())
    groups = [_group(run.tokenizer, Problem("1+2=", "3"), ["3", "9", "4", "3"]),
              _group(run.tokenizer, Problem("4+5=", "9"), ["9", "1"])]
    assert score(run, groups).errors == 2
    assert groups[0].rewards == [1.0, 0.0, 0.0, 1.0] and groups[1].rewards == [0.0, 0.0]
    assert "reward function failed" in capsys.readouterr().out


def test_overlong_penalty_under_dapo():
    run = _run(AdditionTask(), ["learner.algorithm=dapo", "learner.overlong_buffer=2"])
    # max_new_tokens 4, buffer 2: 3 tokens lose 0.5, 4 tokens lose 1
    groups = [_group(run.tokenizer, Problem("1+2=", "3"), ["3", "33", "333", "3333"])]
    score(run, groups)
    assert groups[0].rewards == [1.0, 0.0, -0.5, -1.0]


def test_dynamic_sampling_keeps_groups_with_a_reward_spread():
    run = _run(AdditionTask())
    groups = [_group(run.tokenizer, Problem("1+2=", "3"), ["3", "3"]), _group(run.tokenizer, Problem("1+3=", "4"),
              ["4", "5"]), _group(run.tokenizer, Problem("1+4=", "5"), ["1", "2"])]
    score(run, groups)
    kept = informative(groups)
    assert [g.problem.prompt for g in kept] == ["1+3="]
    samples = training_samples(kept, 2)
    assert [round(s.advantage, 4) for s in samples] == [1.0, -1.0]


def test_group_staleness_counts_adapter_versions_behind_the_learner():
    completions = [Completion(0, [1], [0.0], "stop", version, 0.0, 0) for version in (3, 3)]
    group = Group(Problem("1+1=", "2"), [1], completions)
    assert group.staleness(3) == 0 and group.staleness(5) == 2

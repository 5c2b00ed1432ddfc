"""The rollout half of a training step: which prompts each step trains on, their generation on
the fleet (submitted ahead under rollout.max_staleness), scoring, dynamic sampling, advantages.

`RolloutsAhead` keeps the batches submitted for coming steps. With max_staleness k, the batch
of step t is submitted at the start of step t - k, when the newest adapter the workers hold is
at most k versions behind what the learner will hold at step t: that bounds every sample's
staleness by k without waiting on anything. k = 0 submits each step's batch at its own start,
which is the synchronous loop.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from random import Random

import torch

from learner.losses import group_advantages, informative_groups, overlong_penalty
from rollout_server.dispatch import Batch, Noise
from shared.aqn import aqn_sigma
from shared.config import QerlConfig
from shared.errors import QerlError
from shared.tasks import Problem
from shared.types import Completion, SamplingSettings, TrainSample

SEED_STRIDE = 1_000_003
CALLS_PER_STEP = 128  # generate calls a step may make: the first, plus max_refill_calls (<= 100)


@dataclass
class Group:
    """One prompt and its n sampled completions, with their rewards once scored."""

    problem: Problem
    prompt_ids: list[int]
    completions: list[Completion]
    rewards: list[float] = field(default_factory=list)

    def staleness(self, learner_version: int) -> int:
        """Adapter versions between the one that generated it and the learner's (one chunk, one version)."""
        return learner_version - min(c.adapter_version for c in self.completions)


@dataclass
class Rollouts:
    """One step's groups to train on, and how they were obtained."""

    groups: list[Group]
    first_call: list[Group]
    """The first generate call's groups: the unbiased sample of the policy the rollout/* metrics describe."""
    sigma: float
    seconds: float
    """Wall time the driver spent getting and scoring them."""
    generation_s: float
    """From the first call's first chunk out to its last chunk in (the fleet's generation span)."""
    learner_version: int
    generate_calls: int = 1
    groups_dropped: int = 0
    stale_dropped: int = 0
    reward_errors: int = 0


def step_noise(config: QerlConfig, step: int) -> Noise:
    """The AQN noise of a step's rollouts: the schedule's sigma, a fresh draw every step."""
    return Noise(aqn_sigma(config.aqn, step, config.train.steps), seed=config.train.seed * SEED_STRIDE + step)


def step_sampling(config: QerlConfig, step: int, call: int) -> SamplingSettings:
    return SamplingSettings(config.rollout.samples_per_prompt, config.rollout.temperature,
                            config.rollout.max_new_tokens, seed=config.train.seed * SEED_STRIDE + step * 101 + call)


@dataclass
class _Submitted:
    problems: list[Problem]
    prompt_ids: list[list[int]]
    batch: Batch


class RolloutsAhead:
    """The batches submitted for the coming steps, and the task sampler's state before each, so
    a checkpoint can name the first prompts not trained on (a resumed run draws them again)."""

    def __init__(self, run, rng: Random, first_step: int):
        self.run, self.rng = run, rng
        self.next_step = first_step
        self.submitted: dict[int, _Submitted] = {}
        self.sampler_before: dict[int, tuple] = {}

    def submit_through(self, last_step: int) -> None:
        """Submit every step's first generate call up to `last_step` (and the run's last step)."""
        while self.next_step <= min(last_step, self.run.config.train.steps - 1):
            step, self.next_step = self.next_step, self.next_step + 1
            self.sampler_before[step] = self.rng.getstate()
            self.submitted[step] = self._submit(step, 0, self.run.config.train.prompts_per_step)

    def _submit(self, step: int, call: int, count: int) -> _Submitted:
        run = self.run
        problems = run.task.sample(self.rng, count)
        prompt_ids = run.tokenizer([p.prompt for p in problems], add_special_tokens=False)["input_ids"]
        batch = run.pool.submit(prompt_ids, step_sampling(run.config, step, call), step_noise(run.config, step),
                                order=step * CALLS_PER_STEP + call)
        return _Submitted(problems, prompt_ids, batch)

    def take(self, step: int) -> _Submitted:
        self.submit_through(step)
        self.sampler_before.pop(step, None)
        return self.submitted.pop(step)

    def refill(self, step: int, call: int, count: int) -> _Submitted:
        """An extra generate call for `step`, now (ahead of the batches of later steps)."""
        return self._submit(step, call, count)

    def sampler_state_after(self, step: int) -> tuple:
        """The sampler's state as if nothing after `step` had been drawn."""
        return self.sampler_before.get(step + 1, self.rng.getstate())


def groups_of(run, submitted: _Submitted) -> list[Group]:
    """Wait for a batch; one group per prompt, checked to hold exactly n completions."""
    n = submitted.batch.sampling.samples_per_prompt
    groups = [Group(problem, ids, []) for problem, ids in zip(submitted.problems, submitted.prompt_ids)]
    for completion in run.pool.collect(submitted.batch):
        groups[completion.prompt_index].completions.append(completion)
    # a chunk re-dispatched after a worker died must neither be lost nor counted twice
    wrong = [i for i, g in enumerate(groups) if len(g.completions) != n]
    if wrong:
        raise QerlError(f"internal: prompt {wrong[0]} came back with {len(groups[wrong[0]].completions)} "
                        f"completions, not {n}")
    return groups


def collect(run, step: int, ahead: RolloutsAhead) -> Rollouts:
    """This step's groups, scored: its batch (submitted ahead, or now), samples staler than
    rollout.max_staleness dropped; with dynamic sampling, groups that carry no signal are
    replaced (bounded extra calls)."""
    config = run.config
    wanted = config.train.prompts_per_step
    version = run.pool.state.adapter_version
    started = time.perf_counter()
    first_batch = ahead.take(step)
    first = groups_of(run, first_batch)
    generation_s = first_batch.batch.generation_s()
    fresh = [g for g in first if g.staleness(version) <= config.rollout.max_staleness]
    rollouts = Rollouts(fresh, first, step_noise(config, step).sigma, 0.0, generation_s, version,
                        stale_dropped=len(first) - len(fresh), reward_errors=score(run, first))
    if config.learner.uses_dynamic_sampling():
        kept = informative(fresh)
        rollouts.groups_dropped = len(fresh) - len(kept)
        while len(kept) < wanted and rollouts.generate_calls <= config.learner.max_refill_calls:
            extra = groups_of(run, ahead.refill(step, rollouts.generate_calls, wanted - len(kept)))
            rollouts.generate_calls += 1
            rollouts.reward_errors += score(run, extra)
            useful = informative(extra)
            rollouts.groups_dropped += len(extra) - len(useful)
            kept += useful
        rollouts.groups = kept[:wanted]
    rollouts.seconds = time.perf_counter() - started
    return rollouts


def informative(groups: list[Group]) -> list[Group]:
    keep = informative_groups(torch.tensor([g.rewards for g in groups])) if groups else []
    return [g for g, k in zip(groups, keep) if k]


def score(run, groups: list[Group]) -> int:
    """Each completion's task reward (0 where the reward function raised; returns how many did)
    plus the overlong penalty."""
    config = run.config
    texts = run.tokenizer.batch_decode([c.token_ids for g in groups for c in g.completions], skip_special_tokens=True)
    buffer = config.learner.overlong_tokens(config.rollout.max_new_tokens)
    errors, position = 0, 0
    for group in groups:
        group.rewards = []
        for completion in group.completions:
            text = texts[position]
            position += 1
            try:
                reward = float(run.task.reward(group.problem, text))
                if not math.isfinite(reward):  # NaN would poison the group's advantages and the loss
                    raise ValueError(f"the reward is {reward}")
            except Exception as error:  # one bad sample must not end a week-long run
                if errors == 0:
                    print(f"[qerl] reward function failed on {text!r}: {type(error).__name__}: {error} (scored 0)")
                errors += 1
                reward = 0.0
            penalty = overlong_penalty(len(completion.token_ids), config.rollout.max_new_tokens, buffer,
                                       config.learner.overlong_penalty)
            group.rewards.append(reward + penalty)
    return errors


def training_samples(groups: list[Group], n: int, learner_version: int = 0) -> list[TrainSample]:
    """Group-normalised advantages, one TrainSample per completion, tagged with its staleness."""
    if not groups:
        return []
    advantages = group_advantages(torch.tensor([g.rewards for g in groups]).view(len(groups), n))
    return [
        TrainSample(g.prompt_ids, c.token_ids, c.logprobs, float(a), learner_version - c.adapter_version)
        for g, row in zip(groups, advantages) for c, a in zip(g.completions, row)
    ]


def staleness_metrics(rollouts: Rollouts, max_staleness: int) -> dict[str, float]:
    """How many trained samples lag the learner by 0..k adapter versions, and how many groups
    were too stale to train on."""
    lags = [rollouts.learner_version - c.adapter_version for g in rollouts.groups for c in g.completions]
    record = {f"staleness/{lag}": float(sum(x == lag for x in lags)) for lag in range(max_staleness + 1)}
    return {**record, "staleness/mean": sum(lags) / len(lags) if lags else 0.0,
            "rollout/stale_dropped": float(rollouts.stale_dropped)}

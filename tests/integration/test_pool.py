"""The rollout pool's own logic on a real local Ray, with stand-in workers in place of the vLLM
engines (tests/stand_in_worker.py): each idle worker pulls the next chunk, so a slow one takes
fewer; a worker killed mid-chunk has its chunk served by another and is replaced, loading the
current adapter before it serves; the fleet grows and shrinks between steps; and batches
submitted k steps ahead are never staler than k adapter versions when trained on. The same
logic on real engines: tests/e2e/test_dispatch.py and tests/e2e/test_fleet.py."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from random import Random
from types import SimpleNamespace

import numpy as np
import pytest
import ray
from stand_in_worker import StandInWorker, learner_step

from deploy.rollouts import RolloutsAhead, collect
from rollout_server.dispatch import Noise
from rollout_server.pool import RolloutPool
from shared.config import RolloutConfig, load_config
from shared.errors import QerlError
from shared.prompts import prompt_encoder
from shared.scoring import Scorer, training_grade
from shared.tasks import build_task
from shared.tiny_model import build_tokenizer
from shared.types import AdapterUpdate, SamplingSettings, ServedBase

N = 2
SAMPLING = SamplingSettings(samples_per_prompt=N, temperature=1.0, max_new_tokens=3, seed=17)
NOISE = Noise(sigma=0.01, seed=5)
PROMPTS = [[10 + i, 11 + i, 12] for i in range(8)]
SERVED = ServedBase("stand-in", None, "fp32")


def _pool(workers: int, log=print, **rollout) -> RolloutPool:
    config = RolloutConfig(num_workers=workers, num_cpus_per_worker=0.25, chunk_sequences=N, **rollout)
    return RolloutPool(SERVED, config, 8, log=log, worker_class=StandInWorker)


def _adapter(version: int) -> AdapterUpdate:
    return AdapterUpdate(version, np.zeros(8, np.uint8), {})


def _samples(completions) -> list[tuple]:
    """What a completion is, whichever worker served it."""
    return [(c.prompt_index, tuple(c.token_ids), tuple(c.logprobs), c.adapter_version, c.sigma) for c in completions]


def _wait_until(condition, pool: RolloutPool, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out; live {pool.live()}, starting {list(pool.starting)}"
        pool.admit_started()
        time.sleep(0.05)


def test_each_idle_worker_pulls_the_next_chunk_so_a_slow_one_takes_fewer(ray_local):
    pool = _pool(2)
    try:
        ray.get(pool.workers[0].set_seconds_per_chunk.remote(3.0))
        pool.discard_worker_stats()
        batch = pool.submit(PROMPTS, SAMPLING, NOISE)  # one prompt (N sequences) a chunk
        assert sorted(run.slot for run in pool.running.values()) == [0, 1]  # one chunk a worker at a time
        assert [chunk.first for chunk in pool.queue] == list(range(2, len(PROMPTS)))
        completions = pool.collect(batch)
        stats = pool.worker_metrics(1.0)
        assert (stats["fleet/worker0/requests"], stats["fleet/worker1/requests"]) == (1, len(PROMPTS) - 1)
        assert [c.prompt_index for c in completions] == [i for i in range(len(PROMPTS)) for _ in range(N)]
        assert {c.sigma for c in completions} == {NOISE.sigma}  # the noise went ahead of the generate
    finally:
        pool.shutdown()


def test_a_lower_order_batch_jumps_the_queue_and_slices_cut_one_chunk_a_worker(ray_local):
    pool = _pool(2)
    try:
        ray.get([worker.set_seconds_per_chunk.remote(0.1) for worker in pool.live_workers()])
        later = pool.submit(PROMPTS, SAMPLING, order=5)
        urgent = pool.submit(PROMPTS[:2], SAMPLING, order=1)  # e.g. a step's refill before prefetched batches
        assert [chunk.batch for chunk in pool.queue[:2]] == [urgent, urgent]
        assert len(pool.collect(urgent)) == 2 * N and not later.done()
        assert len(pool.collect(later)) == len(PROMPTS) * N
        pool.config = pool.config.model_copy(update={"dispatch": "slices"})
        pool.discard_worker_stats()
        sliced = pool.generate(PROMPTS, SAMPLING)
        stats = pool.worker_metrics(1.0)
        assert stats["fleet/worker0/requests"] == stats["fleet/worker1/requests"] == 1
        assert _samples(sliced) == _samples(later.completions())  # the cut does not change the samples
    finally:
        pool.shutdown()


def test_a_worker_killed_mid_chunk_is_replaced_and_its_chunk_served_by_another(ray_local):
    lines: list[str] = []
    pool = _pool(2, log=lines.append)
    try:
        pool.update_adapter(_adapter(1))
        expected = pool.generate(PROMPTS, SAMPLING, NOISE)
        pid = ray.get(pool.workers[1].ready.remote())["pid"]
        ray.get(pool.workers[1].set_seconds_per_chunk.remote(60.0))  # holds its next chunk until killed
        batch = pool.submit(PROMPTS, SAMPLING, NOISE)
        assert any(run.slot == 1 for run in pool.running.values())
        os.kill(pid, signal.SIGKILL)
        completions = pool.collect(batch)
        assert _samples(completions) == _samples(expected)  # nothing lost or doubled, the same seeds
        assert Counter(c.prompt_index for c in completions) == {i: N for i in range(len(PROMPTS))}
        assert any(line.startswith("[qerl] rollout worker 1 died") and "a replacement is starting" in line
                   for line in lines), lines
        _wait_until(lambda: pool.live() == [0, 1], pool)
        assert any(line.startswith("[qerl] rollout worker 1 replaced") and line.endswith("adapter version 1")
                   for line in lines), lines
        assert pool.fleet_metrics() == {"fleet/workers": 2, "fleet/target": 2, "fleet/restarts": 1}
        again = pool.generate(PROMPTS, SAMPLING, NOISE)
        assert {c.worker_id for c in again} == {0, 1} and _samples(again) == _samples(expected)
    finally:
        pool.shutdown()


def test_the_fleet_grows_and_shrinks_between_steps(ray_local):
    lines: list[str] = []
    pool = _pool(1, log=lines.append)
    try:
        pool.update_adapter(_adapter(1))
        one = pool.generate(PROMPTS, SAMPLING)
        pool.scale(3)
        assert sorted(pool.starting) == [1, 2] and pool.fleet_metrics()["fleet/target"] == 3
        _wait_until(lambda: pool.live() == [0, 1, 2], pool)
        three = pool.generate(PROMPTS, SAMPLING)
        assert {c.worker_id for c in three} == {0, 1, 2}
        assert _samples(three) == _samples(one)  # the new workers loaded adapter version 1 before serving

        # shrinking while chunks are in flight: the retiring workers finish what they hold
        ray.get([worker.set_seconds_per_chunk.remote(0.3) for worker in pool.live_workers()])
        batch = pool.submit(PROMPTS, SAMPLING)
        pool.scale(1)
        assert pool.retiring == {1, 2} and {1, 2} <= set(pool.workers)
        assert _samples(pool.collect(batch)) == _samples(one)
        pool.generate(PROMPTS[:1], SAMPLING)
        assert pool.live() == [0] and set(pool.workers) == {0} and not pool.retiring

        pool.scale(3)
        pool.scale(1)  # the ones still starting go first
        assert not pool.starting and pool.live() == [0]
        assert "[qerl] rollout workers: 1 -> 3 (2 starting)" in lines and "[qerl] rollout workers: 3 -> 1" in lines
        with pytest.raises(QerlError, match="at least 1 rollout worker"):
            pool.scale(0)
    finally:
        pool.shutdown()


def _train(ahead_by: int, max_staleness: int) -> list:
    """The training loop's rollout schedule with a stand-in learner: batches submitted `ahead_by`
    steps ahead generate while the learner's step runs, and each step pushes a new adapter."""
    config = load_config(None, ["train.steps=6", "train.prompts_per_step=4", f"rollout.samples_per_prompt={N}",
                                "rollout.max_new_tokens=3", f"rollout.chunk_sequences={N}",
                                "rollout.num_workers=2", "rollout.num_cpus_per_worker=0.25",
                                f"rollout.max_staleness={max_staleness}"])
    pool = RolloutPool(SERVED, config.rollout, 8, log=print, worker_class=StandInWorker)
    task = build_task(config.task)
    scorer = Scorer(training_grade(task, config.task), config.task.reward_timeout_s, 1)
    run = SimpleNamespace(config=config, pool=pool, task=task, scorer=scorer,
                          prompts=prompt_encoder(build_tokenizer(), config.task), tokenizer=build_tokenizer())
    ahead, steps = RolloutsAhead(run, Random(0), 0), []
    try:
        for step in range(config.train.steps):
            ahead.submit_through(step + ahead_by)
            rollouts = collect(run, step, ahead)
            steps.append(rollouts)
            pool.wait_for(learner_step.remote(0.3))
            pool.update_adapter(_adapter(step + 1), version=step + 1, wait=max_staleness == 0)
    finally:
        scorer.close()
        pool.shutdown()
    return steps


def _lags(rollouts) -> list[int]:
    return [rollouts.learner_version - c.adapter_version for g in rollouts.groups for c in g.completions]


@pytest.mark.parametrize("k", [0, 1])
def test_batches_submitted_k_steps_ahead_lag_at_most_k_versions(ray_local, k):
    steps = _train(ahead_by=k, max_staleness=k)
    assert [r.learner_version for r in steps] == list(range(6))
    assert all(len(r.groups) == 4 and r.stale_dropped == 0 for r in steps)
    lags = [lag for r in steps for lag in _lags(r)]
    assert max(lags) <= k
    if k:  # the next batch generated during the learner's step, on the adapter before it
        assert sum(lag == 1 for lag in lags) > len(lags) // 2


def test_groups_staler_than_the_bound_are_dropped_and_counted(ray_local):
    steps = _train(ahead_by=2, max_staleness=1)  # a driver running further ahead than the bound
    assert all(max(_lags(r), default=0) <= 1 for r in steps)
    assert sum(r.stale_dropped for r in steps) > 0
    assert all(len(r.groups) + r.stale_dropped == 4 for r in steps)

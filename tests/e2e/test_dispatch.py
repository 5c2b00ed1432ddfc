"""The work queue on real vLLM workers in real Ray actors: the samples do not depend on which
workers served them (the same chunks, seeds and AQN noise give the same tokens and logprobs on a
fleet of 2 or of 1), and the fleet grows and shrinks with `scale`, a new worker loading the
current adapter before it serves and a removed one finishing the chunk it holds. (A slowed
worker taking fewer chunks: with stand-in workers in tests/integration/test_pool.py, on real
ones in tests/e2e/test_bench_fleet.py.)"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import ray

from benchmarks.random_adapter import random_adapter
from rollout_server.dispatch import Noise
from rollout_server.pool import RolloutPool
from rollout_server.worker import RolloutWorker
from shared.config import RolloutConfig
from shared.types import SamplingSettings, ServedBase

pytestmark = pytest.mark.slow

N = 4
SAMPLING = SamplingSettings(samples_per_prompt=N, temperature=1.0, max_new_tokens=6, seed=17)
NOISE = Noise(sigma=0.01, seed=5)  # AQN on: every worker must draw the same noise


@pytest.fixture(scope="module")
def prompts(tiny_model) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    questions = [f"{a}+{b}=" for a, b in zip(range(10, 90, 5), range(31, 99, 4))]
    return tokenizer(questions, add_special_tokens=False)["input_ids"]


def _samples(completions) -> list[tuple]:
    return [(c.prompt_index, tuple(c.token_ids), tuple(c.logprobs), c.adapter_version) for c in completions]


def _wait_until(condition, pool: RolloutPool, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out; live {pool.live()}, starting {list(pool.starting)}"
        pool.admit_started()
        time.sleep(0.1)


def test_samples_do_not_depend_on_the_fleet_as_it_shrinks_and_grows(ray_local, tiny_model, prompts):
    config = RolloutConfig(num_workers=2, num_cpus_per_worker=1, dtype="float32", chunk_sequences=2 * N)
    pool = RolloutPool(ServedBase(str(tiny_model), None, "fp32"), config, 8, log=print, worker_class=RolloutWorker)
    try:
        update = random_adapter(tiny_model, 8, seed=3)
        pool.update_adapter(ray.put(replace(update, version=1)))
        pool.worker_metrics(1.0)
        two = pool.generate(prompts, SAMPLING, NOISE, order=0)
        stats = pool.worker_metrics(1.0)
        assert len(two) == len(prompts) * N and sorted({c.prompt_index for c in two}) == list(range(len(prompts)))
        assert stats["fleet/worker0/requests"] + stats["fleet/worker1/requests"] == len(prompts) // 2
        assert {c.worker_id for c in two} == {0, 1}

        pool.scale(1)  # the highest slot retires: worker 0 serves alone
        assert pool.live() == [0] and 1 not in pool.workers  # idle, so stopped at once
        one = pool.generate(prompts, SAMPLING, NOISE)
        assert {c.worker_id for c in one} == {0}
        assert _samples(one) == _samples(two)  # same tokens and logprobs, whoever served them

        pool.scale(2)  # a new slot starts in the background
        assert list(pool.starting) == [2] and pool.fleet_metrics()["fleet/target"] == 2
        _wait_until(lambda: pool.live() == [0, 2], pool)
        again = pool.generate(prompts, SAMPLING, NOISE)
        assert {c.worker_id for c in again} == {0, 2}
        assert _samples(again) == _samples(two)  # the new worker loaded adapter version 1 before serving

        clean = pool.generate(prompts, SAMPLING)  # no noise: other samples
        assert _samples(clean) != _samples(two)

        # shrinking while chunks are in flight (asynchronous rollouts): the retiring worker
        # finishes what it holds, takes nothing new, and stops once idle
        batch = pool.submit(prompts, SAMPLING, NOISE)
        holding = {run.slot for run in pool.running.values()}
        assert holding == {0, 2}
        pool.scale(1)
        assert pool.retiring == {2} and 2 in pool.workers  # still generating its chunk
        assert _samples(pool.collect(batch)) == _samples(two)
        pool.generate(prompts[:2], SAMPLING)
        assert pool.live() == [0] and 2 not in pool.workers and not pool.retiring
    finally:
        pool.shutdown()

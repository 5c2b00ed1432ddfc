"""Scoring off the driver's critical path, on a real vLLM worker: while the scorer's threads
compute rewards, the driver's idle hook (`RolloutPool.pump_once`) keeps handing the queued
chunks of the next batch to the worker; without it they would wait for the driver."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import ray

from benchmarks.random_adapter import random_adapter
from rollout_server.pool import RolloutPool
from shared.config import RolloutConfig
from shared.scoring import Scorer
from shared.tasks import Problem
from shared.types import SamplingSettings, ServedBase

pytestmark = pytest.mark.slow

N = 2
SAMPLING = SamplingSettings(samples_per_prompt=N, temperature=1.0, max_new_tokens=4, seed=3)


def test_queued_chunks_keep_flowing_while_rewards_compute(ray_local, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = tokenizer([f"{a}+{a}=" for a in range(10, 15)], add_special_tokens=False)["input_ids"]
    config = RolloutConfig(num_workers=1, num_cpus_per_worker=1, dtype="float32", chunk_sequences=N)
    pool = RolloutPool(ServedBase(str(tiny_model), None, "fp32"), config, 8, log=print)
    try:
        pool.update_adapter(ray.put(replace(random_adapter(tiny_model, 8, seed=3), version=1)))
        first = pool.submit(prompts[:1], SAMPLING, order=0)
        following = pool.submit(prompts, SAMPLING, order=1)  # 5 chunks queued behind the first batch
        texts = tokenizer.batch_decode([c.token_ids for c in pool.collect(first)], skip_special_tokens=True)
        problems = [Problem("q", "a")] * len(texts)

        def slow_reward(problem: Problem, text: str, patience: float) -> float:
            deadline = time.monotonic() + patience
            while not following.done() and time.monotonic() < deadline:
                time.sleep(0.02)
            return 1.0 if following.done() else 0.0

        # the driver only waiting: the worker finishes at most the chunk it holds, nobody takes it in
        waiting = Scorer(lambda p, t: slow_reward(p, t, 2.0), timeout_s=60, threads=1)
        assert waiting.score(problems, texts).rewards == [0.0] * len(texts)
        waiting.close()
        assert not following.done()

        pumping = Scorer(lambda p, t: slow_reward(p, t, 120.0), timeout_s=300, threads=1)
        started = time.monotonic()
        scores = pumping.score(problems, texts, keep_busy=pool.pump_once)
        pumping.close()
        assert following.done() and scores.rewards == [1.0] * len(texts) and scores.errors == 0
        assert time.monotonic() - started < 120
    finally:
        pool.shutdown()

"""A stand-in rollout worker: the methods `RolloutPool` calls on a `RolloutWorker`, without an
engine, so the pool's queue, dispatch, scaling, dead-worker and asynchronous logic run in seconds
on a real local Ray.

Its completions are canned but not constant: each sample's tokens and logprobs are drawn from
the batch seed, the prompt's index in the whole batch, the sample's number, the AQN noise and
the adapter version the worker holds. So, as with the real engine, a chunk gives the same
samples on whichever worker serves it, and other seeds, noise or adapters give other samples.
The real worker and its engine keep their own tests (tests/integration/test_rollout_worker.py,
tests/e2e/test_dispatch.py)."""

from __future__ import annotations

import os
import sys
import time
from random import Random

import ray
from ray import cloudpickle

from shared.config import RolloutConfig
from shared.types import AdapterLoaded, AdapterUpdate, Completion, SamplingSettings, ServedBase

# Ray ships this class to its worker processes; they cannot import tests/ by name
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class StandInWorker:
    def __init__(self, worker_id: int, served: ServedBase, config: RolloutConfig, max_lora_rank: int):
        self.worker_id = worker_id
        self.adapter_version = 0
        self.sigma, self.noise_seed = 0.0, 0
        self.seconds_per_chunk = 0.0

    def ready(self) -> dict:
        return {"worker_id": self.worker_id, "start_s": 0.0, "pid": os.getpid(), "gpu_memory_gib": None}

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, first_prompt: int = 0) -> list[Completion]:
        time.sleep(self.seconds_per_chunk)
        completions = []
        for index, prompt in enumerate(prompts):
            for sample in range(sampling.samples_per_prompt):
                rng = Random(f"{sampling.seed}/{first_prompt + index}/{sample}/{prompt}/"
                             f"{self.sigma}/{self.noise_seed}/{self.adapter_version}")
                tokens = [rng.randrange(3, 90) for _ in range(sampling.max_new_tokens)]
                logprobs = [-3 * rng.random() for _ in tokens]
                completions.append(Completion(index, tokens, logprobs, "length", self.adapter_version,
                                              self.sigma, self.worker_id))
        return completions

    def load_adapter(self, update: AdapterUpdate) -> AdapterLoaded:
        self.adapter_version = update.version
        return AdapterLoaded(update.version, 0.1)

    def set_noise(self, sigma: float, seed: int) -> int:
        self.sigma, self.noise_seed = sigma, seed
        return 1

    def shutdown(self) -> None:
        pass

    # what the tests steer

    def set_seconds_per_chunk(self, seconds: float) -> None:
        """Make every generate call take `seconds` (a slow or busy node; long enough to kill it mid-chunk)."""
        self.seconds_per_chunk = seconds


@ray.remote(num_cpus=0)
def learner_step(seconds: float) -> float:
    """A learner's step as the driver waits on it: a reference that is ready after `seconds`."""
    time.sleep(seconds)
    return seconds

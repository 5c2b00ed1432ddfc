"""RolloutPool: the driver's handle on N RolloutWorker actors.

It shards prompts across workers, pushes adapter updates (one object-store reference, every
worker swaps it in from memory) and broadcasts the AQN sigma. Workers are placed by Ray on any
node with the resources the config asks for.
"""

from __future__ import annotations

import ray

from rollout_server.worker import RolloutWorker
from shared.config import RolloutConfig
from shared.types import AdapterUpdate, Completion, SamplingSettings


class RolloutPool:
    def __init__(self, model_path: str, config: RolloutConfig, max_lora_rank: int, log=print):
        self.model_path = model_path
        self.config = config
        self.max_lora_rank = max_lora_rank
        actor = ray.remote(RolloutWorker).options(
            num_cpus=config.num_cpus_per_worker,
            num_gpus=config.num_gpus_per_worker,
        )
        self.workers = [
            actor.remote(index, model_path, config, max_lora_rank) for index in range(config.num_workers)
        ]
        for info in ray.get([worker.ready.remote() for worker in self.workers]):
            log(f"[qerl] rollout worker {info['worker_id']} ready (engine start {info['start_s']} s)")

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Completion]:
        """Completions for every prompt, in prompt order, `samples_per_prompt` each."""
        shards = _contiguous_shards(len(prompts), len(self.workers))
        pending = [
            worker.generate.remote(
                prompts[start:stop],
                SamplingSettings(
                    sampling.samples_per_prompt, sampling.temperature, sampling.max_new_tokens,
                    seed=sampling.seed + 7919 * index,
                ),
            )
            for index, (worker, (start, stop)) in enumerate(zip(self.workers, shards))
            if stop > start
        ]
        starts = [start for start, stop in shards if stop > start]
        completions = []
        for start, shard in zip(starts, ray.get(pending)):
            for completion in shard:
                completions.append(_shift_prompt_index(completion, start))
        return completions

    def update_adapter(self, update: AdapterUpdate | ray.ObjectRef) -> list[float]:
        """Every worker swaps in the adapter; returns each worker's load time in ms."""
        return ray.get([worker.load_adapter.remote(update) for worker in self.workers])

    def set_noise(self, sigma: float, seed: int) -> None:
        ray.get([worker.set_noise.remote(sigma, seed + index) for index, worker in enumerate(self.workers)])

    def shutdown(self) -> None:
        ray.get([worker.shutdown.remote() for worker in self.workers])
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


def _contiguous_shards(count: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _shift_prompt_index(completion: Completion, offset: int) -> Completion:
    from dataclasses import replace

    return replace(completion, prompt_index=completion.prompt_index + offset)


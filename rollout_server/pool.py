"""RolloutPool: the driver's handle on N RolloutWorker actors, and the fleet's state.

The pool holds what every worker must serve: the current adapter (an object-store reference
and its version) and the AQN sigma with its seed. It shards prompts across workers (`submit`
returns one pending shard per worker, `collect` gathers them as they finish with `ray.wait`),
pushes adapter updates (one object-store reference, every worker swaps it in from memory) and
broadcasts the AQN sigma. Workers are placed by Ray on any node with the resources the config
asks for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import ray

from rollout_server.worker import RolloutWorker, worker_actor_options
from shared.config import RolloutConfig
from shared.errors import QerlError
from shared.progress import progress
from shared.types import AdapterLoaded, AdapterUpdate, Completion, SamplingSettings, ServedBase, contiguous_slices


@dataclass(frozen=True)
class PendingShard:
    """A shard of prompts in flight on one worker; its completions' prompt indices start at
    `first_prompt` of the whole batch."""

    ref: ray.ObjectRef
    first_prompt: int


@dataclass
class FleetState:
    adapter: ray.ObjectRef | None = None
    adapter_version: int = 0
    sigma: float = 0.0
    noise_seed: int = 0


class RolloutPool:
    def __init__(self, served: ServedBase, config: RolloutConfig, max_lora_rank: int, log=print,
                 worker_class: type = RolloutWorker, log_dir: str | None = None):
        self.served = served
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.state = FleetState()
        actor = ray.remote(worker_class)
        self.workers = [
            actor.options(**worker_actor_options(config, index, log_dir)).remote(index, served, config, max_lora_rank)
            for index in range(config.num_workers)
        ]
        with progress(len(self.workers), "starting rollout engines") as bar:
            for index, worker in enumerate(self.workers):
                info = ready_or_error(worker, f"rollout worker {index}")
                bar.update()
                log(f"[qerl] rollout worker {info['worker_id']} ready (engine start {info['start_s']} s"
                    f"{gpu_memory_note(info)})")

    def submit(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[PendingShard]:
        """Start generating: one contiguous shard of the prompts per worker (each prompt's sampling
        seed follows from its index in the whole batch, whichever worker serves it)."""
        pending = []
        for index, (start, stop) in enumerate(contiguous_slices(len(prompts), len(self.workers))):
            if stop == start:
                continue
            ref = self.workers[index].generate.remote(prompts[start:stop], sampling, start)
            pending.append(PendingShard(ref, start))
        return pending

    def collect(self, pending: list[PendingShard]) -> list[Completion]:
        """The completions of every pending shard, in prompt order, gathered as shards finish."""
        by_ref = {shard.ref: shard for shard in pending}
        finished: dict[int, list[Completion]] = {}
        waiting = list(by_ref)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1)
            shard = by_ref[done[0]]
            finished[shard.first_prompt] = [
                replace(c, prompt_index=c.prompt_index + shard.first_prompt) for c in ray.get(done[0])
            ]
        return [c for first in sorted(finished) for c in finished[first]]

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Completion]:
        """Completions for every prompt, in prompt order, `samples_per_prompt` each."""
        return self.collect(self.submit(prompts, sampling))

    def update_adapter(self, update: AdapterUpdate | ray.ObjectRef) -> list[float]:
        """Every worker swaps in the adapter; returns each worker's load time in ms."""
        ref = update if isinstance(update, ray.ObjectRef) else ray.put(update)
        loads: list[AdapterLoaded] = ray.get([worker.load_adapter.remote(ref) for worker in self.workers])
        self.state.adapter, self.state.adapter_version = ref, loads[0].version
        return [load.load_ms for load in loads]

    def set_noise(self, sigma: float, seed: int) -> None:
        """AQN: every worker draws fresh RMSNorm noise (worker i from seed + i)."""
        ray.get([worker.set_noise.remote(sigma, seed + index) for index, worker in enumerate(self.workers)])
        self.state.sigma, self.state.noise_seed = sigma, seed

    def shutdown(self) -> None:
        ray.get([worker.shutdown.remote() for worker in self.workers])
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


def ready_or_error(actor, name: str) -> dict:
    """The actor's `ready()` answer; a QerlError naming the actor and the cause's last line if
    it could not start (a bad model folder, not enough GPU memory, ...)."""
    try:
        return ray.get(actor.ready.remote())
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
        raise QerlError(f"{name} could not start: {root_cause(error)}") from None


def gpu_memory_note(ready: dict) -> str:
    """", N GiB on the GPU" from an actor's ready() answer; empty off the GPU."""
    return f", {ready['gpu_memory_gib']:.1f} GiB on the GPU" if ready["gpu_memory_gib"] else ""


def root_cause(error: BaseException) -> str:
    """The last line of the innermost traceback in a Ray error (the line a user can act on)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|OutOfMemoryError)\b", line)]
    cause = (causes or lines or [type(error).__name__])[-1][:400]
    return cause.removeprefix("shared.errors.QerlError: ")  # already a message meant for the user

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

# what ray.get raises for a task of a worker whose process is gone
DEAD_WORKER = (ray.exceptions.RayActorError,)


MAX_RESTARTS = 3
"""Replacements the pool starts for one worker slot before it leaves the slot empty."""


@dataclass(frozen=True)
class PendingShard:
    """A shard of prompts in flight on worker `worker`; its completions' prompt indices start at
    `first_prompt` of the whole batch. The prompts and settings stay with it, so a shard whose
    worker dies can go to another one (the same seeds, so the same samples)."""

    ref: ray.ObjectRef
    first_prompt: int
    worker: int
    prompts: list[list[int]]
    sampling: SamplingSettings


@dataclass
class FleetState:
    adapter: ray.ObjectRef | None = None
    adapter_version: int = 0
    sigma: float = 0.0
    noise_seed: int = 0
    restarts: int = 0
    """Replacement workers started since the run began."""


class RolloutPool:
    def __init__(self, served: ServedBase, config: RolloutConfig, max_lora_rank: int, log=print,
                 worker_class: type = RolloutWorker, log_dir: str | None = None):
        self.served = served
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.log = log
        self.log_dir = log_dir
        self.state = FleetState()
        self._actor = ray.remote(worker_class)
        self.workers: list = [self._start(index) for index in range(config.num_workers)]
        """Worker i's actor, or None while its slot is empty (dead, replacement not yet serving)."""
        self.replacements: dict[int, tuple] = {}  # slot -> (actor, its ready() reference)
        self.attempts = [0] * config.num_workers
        with progress(len(self.workers), "starting rollout engines") as bar:
            for index, worker in enumerate(self.workers):
                info = ready_or_error(worker, f"rollout worker {index}")
                bar.update()
                log(f"[qerl] rollout worker {info['worker_id']} ready (engine start {info['start_s']} s"
                    f"{gpu_memory_note(info)})")

    def _start(self, index: int):
        options = worker_actor_options(self.config, index, self.log_dir)
        return self._actor.options(**options).remote(index, self.served, self.config, self.max_lora_rank)

    def live(self) -> list[int]:
        return [index for index, worker in enumerate(self.workers) if worker is not None]

    def fleet_metrics(self) -> dict[str, float]:
        return {"fleet/workers": len(self.live()), "fleet/restarts": self.state.restarts}

    # -- dead workers: re-dispatch, replace in the background, admit once it serves the current state

    def _worker_died(self, index: int, error: BaseException) -> None:
        if self.workers[index] is None:
            return
        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = None
        replacing = self.attempts[index] < MAX_RESTARTS
        cause = root_cause(error).split(". ")[0]  # Ray's note on a dead worker runs to a paragraph
        self.log(f"[qerl] rollout worker {index} died ({cause}); its prompts go to the live workers"
                 + ("; a replacement is starting" if replacing else f"; {MAX_RESTARTS} replacements failed, "
                    "its slot stays empty"))
        if replacing:
            self.attempts[index] += 1
            self.state.restarts += 1
            actor = self._start(index)
            self.replacements[index] = (actor, actor.ready.remote())
        if not self.live() and not self.replacements:
            raise QerlError(f"every rollout worker is dead (the last, worker {index}: {cause})")

    def admit_replacements(self, wait: bool = False) -> None:
        """Replacements whose engine is up get the fleet's adapter and AQN noise, then serve.
        `wait`: block until at least one worker is live (when none is)."""
        while self.replacements:
            refs = {ready: index for index, (_, ready) in self.replacements.items()}
            done, _ = ray.wait(list(refs), num_returns=1, timeout=None if wait and not self.live() else 0)
            if not done:
                return
            index = refs[done[0]]
            actor, _ = self.replacements.pop(index)
            try:
                info = ray.get(done[0])
                if self.state.adapter is not None:
                    ray.get(actor.load_adapter.remote(self.state.adapter))
                ray.get(actor.set_noise.remote(self.state.sigma, self.state.noise_seed + index))
            except DEAD_WORKER as error:
                self.workers[index] = actor
                self._worker_died(index, error)
                continue
            self.workers[index] = actor
            self.log(f"[qerl] rollout worker {index} replaced (engine start {info['start_s']} s), serving adapter "
                     f"version {self.state.adapter_version}")

    def _on_live_workers(self, call) -> dict[int, object]:
        """call(index, worker) on every live worker, its result by slot; a worker that died on the
        way is replaced (its result left out)."""
        refs = {index: call(index, self.workers[index]) for index in self.live()}
        results = {}
        for index, ref in refs.items():
            try:
                results[index] = ray.get(ref)
            except DEAD_WORKER as error:
                self._worker_died(index, error)
        return results

    # -- the fleet's work

    def submit(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[PendingShard]:
        """Start generating: one contiguous shard of the prompts per live worker (each prompt's
        sampling seed follows from its index in the whole batch, whichever worker serves it)."""
        self.admit_replacements(wait=True)
        live = self.live()
        pending = []
        for slot, (start, stop) in zip(live, contiguous_slices(len(prompts), len(live))):
            if stop > start:
                pending.append(self._dispatch(slot, prompts[start:stop], sampling, start))
        return pending

    def _dispatch(self, slot: int, prompts: list[list[int]], sampling: SamplingSettings, first: int) -> PendingShard:
        ref = self.workers[slot].generate.remote(prompts, sampling, first)
        return PendingShard(ref, first, slot, prompts, sampling)

    def collect(self, pending: list[PendingShard]) -> list[Completion]:
        """The completions of every pending shard, in prompt order, gathered as shards finish; the
        shard of a worker that dies goes to another live worker."""
        by_ref = {shard.ref: shard for shard in pending}
        finished: dict[int, list[Completion]] = {}
        waiting = list(by_ref)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1)
            shard = by_ref.pop(done[0])
            try:
                completions = ray.get(done[0])
            except DEAD_WORKER as error:
                self._worker_died(shard.worker, error)
                self.admit_replacements(wait=True)
                live = self.live()
                retry = self._dispatch(live[shard.first_prompt % len(live)], shard.prompts, shard.sampling,
                                       shard.first_prompt)
                by_ref[retry.ref] = retry
                waiting.append(retry.ref)
                continue
            finished[shard.first_prompt] = [
                replace(c, prompt_index=c.prompt_index + shard.first_prompt) for c in completions
            ]
        return [c for first in sorted(finished) for c in finished[first]]

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Completion]:
        """Completions for every prompt, in prompt order, `samples_per_prompt` each."""
        return self.collect(self.submit(prompts, sampling))

    def update_adapter(self, update: AdapterUpdate | ray.ObjectRef) -> list[float]:
        """Every live worker swaps in the adapter (a replacement gets it before it serves);
        returns each worker's load time in ms."""
        ref = update if isinstance(update, ray.ObjectRef) else ray.put(update)
        self.state.adapter = ref
        loads: dict[int, AdapterLoaded] = self._on_live_workers(lambda i, w: w.load_adapter.remote(ref))
        if not loads:  # every worker died on the way: the replacements load it when admitted
            self.admit_replacements(wait=True)
            return [0.0]
        self.state.adapter_version = next(iter(loads.values())).version
        return [load.load_ms for load in loads.values()]

    def set_noise(self, sigma: float, seed: int) -> None:
        """AQN: every worker draws fresh RMSNorm noise (worker i from seed + i)."""
        self.state.sigma, self.state.noise_seed = sigma, seed
        self._on_live_workers(lambda i, w: w.set_noise.remote(sigma, seed + i))

    def shutdown(self) -> None:
        actors = [w for w in self.workers if w is not None] + [a for a, _ in self.replacements.values()]
        stopping = [actor.shutdown.remote() for actor in actors]  # all at once, as before
        for actor, ref in zip(actors, stopping):
            try:
                ray.get(ref, timeout=60)
            except (DEAD_WORKER, ray.exceptions.GetTimeoutError):
                pass
            ray.kill(actor)
        self.workers, self.replacements = [], {}


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

"""RolloutPool: the driver's handle on the RolloutWorker actors, and the fleet's state.

The pool holds what every worker must serve (the current adapter, as an object-store reference
and its version) and the work queue (`rollout_server.dispatch`): `submit` cuts a batch of
prompts into chunks, and whenever a worker is idle it gets the next chunk, preceded by the
batch's AQN noise where the worker holds other noise. The driver drives the queue while it
waits (`collect` for a batch, `wait_for` for anything else, such as the learner's step), so
generation goes on while the learner trains when batches are submitted ahead.

The fleet is elastic: `scale(n)` starts workers in the background or retires some (a retiring
worker finishes the chunk it holds first); a worker whose process dies has its chunk put back
in the queue and is replaced. A new or replacement worker loads the current adapter before it
is given any work. Workers are placed by Ray on any node with the resources the config asks for.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import ray

from rollout_server.dispatch import NO_NOISE, Batch, Chunk, Noise, WorkerStats, cut
from rollout_server.worker import ENGINE_EXIT_GRACE_S, RolloutWorker, worker_actor_options
from shared.config import RolloutConfig
from shared.errors import QerlError
from shared.progress import progress
from shared.types import AdapterLoaded, AdapterUpdate, Completion, SamplingSettings, ServedBase, contiguous_slices

# what ray.get raises for a task of a worker whose process is gone
DEAD_WORKER = (ray.exceptions.RayActorError,)


MAX_RESTARTS = 3
"""Starts the pool retries for one worker slot (after a death or a failed start) before it
leaves the slot empty."""
SHUTDOWN_WAIT_S = ENGINE_EXIT_GRACE_S + 15
"""How long the pool waits for a worker's shutdown call: its engine's exit grace and a margin."""


@dataclass
class FleetState:
    adapter: ray.ObjectRef | None = None
    adapter_version: int = 0
    restarts: int = 0
    """Replacement workers started since the run began."""


@dataclass
class Running:
    """A chunk in flight on worker `slot`, and the calls queued before it on that worker (its
    noise), which must have succeeded too."""

    slot: int
    chunk: Chunk
    started: float
    before: list[ray.ObjectRef] = field(default_factory=list)


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
        self.target = config.num_workers
        self.workers: dict[int, ray.actor.ActorHandle] = {}
        """Live workers by slot."""
        self.starting: dict[int, tuple] = {}  # slot -> (actor, its ready() reference)
        self.retiring: set[int] = set()  # live workers given no more work, stopped once idle
        self.attempts: dict[int, int] = {}
        self.noise_on: dict[int, Noise] = {}
        self.queue: list[Chunk] = []
        self.running: dict[ray.ObjectRef, Running] = {}
        self.pending_loads: dict[ray.ObjectRef, int] = {}  # adapter pushes not yet confirmed, by slot
        self.load_ms: list[tuple[int, float]] = []  # (slot, ms) of confirmed adapter loads
        self.stats: dict[int, WorkerStats] = {}
        self.served_before: set[int] = set()
        self._next_slot = 0
        actors = {self._new_slot(): None for _ in range(config.num_workers)}
        for slot in actors:
            actors[slot] = self._start_actor(slot)
        with progress(len(actors), "starting rollout engines") as bar:
            for slot, actor in actors.items():
                info = ready_or_error(actor, f"rollout worker {slot}")
                bar.update()
                self._admit(slot, actor)
                log(f"[qerl] rollout worker {info['worker_id']} ready (engine start {info['start_s']} s"
                    f"{gpu_memory_note(info)})")

    # -- the fleet

    def _new_slot(self) -> int:
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self.attempts[slot] = 0
        return slot

    def _start_actor(self, slot: int):
        options = worker_actor_options(self.config, slot, self.log_dir)
        return self._actor.options(**options).remote(slot, self.served, self.config, self.max_lora_rank)

    def _start_in_background(self, slot: int) -> None:
        actor = self._start_actor(slot)
        self.starting[slot] = (actor, actor.ready.remote())

    def _admit(self, slot: int, actor) -> None:
        self.served_before.add(slot)
        self.workers[slot] = actor
        self.noise_on[slot] = NO_NOISE
        self.stats.setdefault(slot, WorkerStats())

    def live(self) -> list[int]:
        """Slots of the workers that take work (live and not retiring)."""
        return sorted(slot for slot in self.workers if slot not in self.retiring)

    def live_workers(self) -> list:
        return [self.workers[slot] for slot in self.live()]

    def scale(self, target: int) -> None:
        """Grow or shrink the fleet to `target` workers: new ones start in the background and
        serve once they hold the current adapter; removed ones (starting ones first) stop once
        the chunk they hold is done."""
        if target < 1:
            raise QerlError(f"a fleet needs at least 1 rollout worker, not {target}")
        before = len(self.live()) + len(self.starting)
        self.target = target
        while self.retiring and len(self.live()) + len(self.starting) < target:
            self.retiring.discard(max(self.retiring))  # a retiring worker is the cheapest to keep
        while len(self.live()) + len(self.starting) > target and self.starting:
            slot = max(self.starting)
            ray.kill(self.starting.pop(slot)[0])
        excess = len(self.live()) + len(self.starting) - target
        if excess > 0:
            self.retiring.update(self.live()[-excess:])
        while len(self.live()) + len(self.starting) < target:
            self._start_in_background(self._new_slot())
        if target != before:
            self.log(f"[qerl] rollout workers: {before} -> {target}"
                     + (f" ({len(self.starting)} starting)" if self.starting else ""))
        self._stop_idle_retiring()

    def _stop_idle_retiring(self) -> None:
        busy = {run.slot for run in self.running.values()} | set(self.pending_loads.values())
        for slot in sorted(self.retiring - busy):
            self.retiring.discard(slot)
            actor = self.workers.pop(slot)
            self.noise_on.pop(slot, None)
            _stop_actor(actor)
            self.log(f"[qerl] rollout worker {slot} retired")

    def fleet_metrics(self) -> dict[str, float]:
        return {"fleet/workers": len(self.live()), "fleet/target": self.target, "fleet/restarts": self.state.restarts}

    def worker_metrics(self, window_s: float) -> dict[str, float]:
        """Each worker's requests (chunks), prompts, tokens/s while generating and busy fraction
        of `window_s` since the last call; then the counts start again."""
        record = {}
        for slot, stats in sorted(self.stats.items()):
            if stats.chunks or slot in self.workers:
                record |= stats.metrics(f"fleet/worker{slot}", window_s)
        self.discard_worker_stats()
        return record

    def discard_worker_stats(self) -> None:
        """Start the per-worker counts again (work that is not a training step's, e.g. evaluation)."""
        self.stats = {slot: WorkerStats() for slot in self.workers}

    # -- dead workers and failed starts: requeue, replace in the background, admit once it serves

    def _worker_died(self, slot: int, error: BaseException) -> None:
        actor = self.workers.pop(slot, None)
        if actor is None:
            return
        ray.kill(actor, no_restart=True)
        self.noise_on.pop(slot, None)
        for ref in [ref for ref, run in self.running.items() if run.slot == slot]:
            self._requeue(self.running.pop(ref).chunk)
        for ref in [ref for ref, owner in self.pending_loads.items() if owner == slot]:
            del self.pending_loads[ref]
        cause = root_cause(error).split(". ")[0]  # Ray's note on a dead worker runs to a paragraph
        if slot in self.retiring:
            self.retiring.discard(slot)
            self.log(f"[qerl] rollout worker {slot} died while retiring ({cause})")
            return
        self.log(f"[qerl] rollout worker {slot} died ({cause}); its prompts go to the live workers"
                 + self._restart(slot))
        self._check_any_left(slot, cause)

    def _start_failed(self, slot: int, error: BaseException) -> None:
        cause = root_cause(error)
        self.log(f"[qerl] rollout worker {slot} could not start ({cause})" + self._restart(slot))
        self._check_any_left(slot, cause)

    def _restart(self, slot: int) -> str:
        """Start `slot` again if it has starts left and the fleet is short; the log line's tail."""
        if len(self.live()) + len(self.starting) >= self.target:
            return ""
        if self.attempts[slot] >= MAX_RESTARTS:
            return f"; {MAX_RESTARTS} replacements failed, its slot stays empty"
        self.attempts[slot] += 1
        self.state.restarts += 1
        self._start_in_background(slot)
        return "; a replacement is starting"

    def _check_any_left(self, slot: int, cause: str) -> None:
        if not self.workers and not self.starting:
            raise QerlError(f"every rollout worker is dead (the last, worker {slot}: {cause})")

    def admit_started(self, wait: bool = False) -> None:
        """Started workers whose engine is up load the fleet's adapter, then take work.
        `wait`: block until at least one worker is live (when none is)."""
        while self.starting:
            refs = {ready: slot for slot, (_, ready) in self.starting.items()}
            block = wait and not self.live()
            done, _ = ray.wait(list(refs), num_returns=1, timeout=None if block else 0)
            if not done:
                return
            slot = refs[done[0]]
            actor, _ = self.starting.pop(slot)
            try:
                info = ray.get(done[0])
                if self.state.adapter is not None:
                    ray.get(actor.load_adapter.remote(self.state.adapter))
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
                ray.kill(actor)
                self._start_failed(slot, error)
                continue
            what = "replaced" if slot in self.served_before else "added"
            self._admit(slot, actor)
            self.log(f"[qerl] rollout worker {slot} {what} (engine start {info['start_s']} s), serving adapter "
                     f"version {self.state.adapter_version}")

    # -- the work queue

    def submit(self, prompts: list[list[int]], sampling: SamplingSettings, noise: Noise = NO_NOISE,
               order: int = 0) -> Batch:
        """Queue `prompts` (each for `samples_per_prompt` completions under `noise`) and start on
        them; `collect` returns their completions. Chunks go out by `order`, then prompt index."""
        batch = Batch(order, sampling, noise)
        for first, prompts_of_chunk in cut(prompts, self._chunk_prompts(len(prompts), sampling)):
            self._requeue(Chunk(batch, first, prompts_of_chunk))
            batch.chunks_left += 1
        self._dispatch()
        return batch

    def _chunk_prompts(self, prompts: int, sampling: SamplingSettings) -> int:
        if self.config.dispatch == "slices":  # one contiguous slice per live worker
            self.admit_started(wait=True)
            return max(stop - start for start, stop in contiguous_slices(prompts, len(self.live())))
        return max(1, self.config.chunk_sequences // sampling.samples_per_prompt)

    def _requeue(self, chunk: Chunk) -> None:
        self.queue.append(chunk)
        self.queue.sort(key=Chunk.sort_key)

    def _dispatch(self) -> None:
        """The next chunks to the idle workers (lowest slot first)."""
        busy = {run.slot for run in self.running.values()}
        for slot in self.live():
            if not self.queue:
                return
            if slot in busy:
                continue
            chunk = self.queue.pop(0)
            worker, before = self.workers[slot], []
            if self.noise_on[slot] != chunk.batch.noise:  # queued ahead of the generate on that worker
                before.append(worker.set_noise.remote(chunk.batch.noise.sigma, chunk.batch.noise.seed))
                self.noise_on[slot] = chunk.batch.noise
            ref = worker.generate.remote(chunk.prompts, chunk.batch.sampling, chunk.first)
            now = time.perf_counter()
            self.running[ref] = Running(slot, chunk, now, before)
            if chunk.batch.first_dispatch is None:
                chunk.batch.first_dispatch = now

    def _pump(self, also: list[ray.ObjectRef] = (), block: bool = True) -> None:
        """Admit started workers, stop idle retiring ones, hand out chunks, then wait for one
        chunk or start to finish (or one of `also`) and take it in."""
        self.admit_started(wait=bool(self.queue))
        self._take_loads(wait=False)
        self._stop_idle_retiring()
        self._dispatch()
        starting = {ready: slot for slot, (_, ready) in self.starting.items()}
        waiting = [*self.running, *starting, *also]
        if not waiting:
            if self.queue:
                raise QerlError("internal: prompts are queued and no rollout worker is live or starting")
            return
        done, _ = ray.wait(waiting, num_returns=1, timeout=None if block else 0)
        for ref in done:
            if ref in self.running:
                self._chunk_finished(ref)

    def _chunk_finished(self, ref: ray.ObjectRef) -> None:
        run = self.running.pop(ref)
        try:
            ray.get(run.before)
            completions: list[Completion] = ray.get(ref)
        except DEAD_WORKER as error:
            self._requeue(run.chunk)  # the same prompts, seeds and noise, on another worker
            self._worker_died(run.slot, error)
            return
        except ray.exceptions.RayTaskError as error:
            raise QerlError(f"rollout worker {run.slot} failed: {root_cause(error)}") from None
        self.stats[run.slot].add(run.chunk, completions, time.perf_counter() - run.started)
        run.chunk.finish(completions)

    def collect(self, batch: Batch) -> list[Completion]:
        """The batch's completions in prompt order, once every chunk is in (the chunk of a worker
        that died goes to another one: the same seeds, so the same samples)."""
        while not batch.done():
            chunks = [run.chunk for run in self.running.values()] + self.queue
            if not any(chunk.batch is batch for chunk in chunks):  # lost: would wait forever
                raise QerlError("internal: a batch is incomplete and no chunk of it is queued or in flight")
            self._pump()
        self._dispatch()  # what is queued behind it starts now, not at the next call
        return batch.completions()

    def pump_once(self) -> None:
        """Hand out queued chunks and take in finished ones, without waiting: what the driver does
        in its idle moments (e.g. while rewards are computed) so that no worker waits on it."""
        self._pump(block=False)

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, noise: Noise = NO_NOISE,
                 order: int = 0) -> list[Completion]:
        """Completions for every prompt, in prompt order, `samples_per_prompt` each."""
        return self.collect(self.submit(prompts, sampling, noise, order))

    def wait_for(self, ref: ray.ObjectRef) -> tuple[object, float]:
        """`ray.get(ref)` while the queue keeps the workers busy; also returns the fraction of
        the wait during which some chunk was being generated."""
        started = time.perf_counter()
        overlapped = 0.0
        while not ray.wait([ref], timeout=0)[0]:
            tick = time.perf_counter()
            generating = bool(self.running) or bool(self.queue)
            self._pump(also=[ref])
            if generating:
                overlapped += time.perf_counter() - tick
        waited = time.perf_counter() - started
        return ray.get(ref), (overlapped / waited if waited > 0 else 0.0)

    # -- what every worker serves

    def update_adapter(self, update: AdapterUpdate | ray.ObjectRef, version: int | None = None,
                       wait: bool = True) -> list[float]:
        """Every live worker swaps in the adapter (a worker that starts later loads it before it
        serves). A worker in the middle of a chunk loads it after that chunk, before its next.
        `wait`: block until every worker has it and return each one's load time in ms; else the
        times are reported by a later `load_times`."""
        ref = update if isinstance(update, ray.ObjectRef) else ray.put(update)
        self.state.adapter = ref
        if version is not None:
            self.state.adapter_version = version
        for slot, worker in self.workers.items():
            self.pending_loads[worker.load_adapter.remote(ref)] = slot
        if not wait:
            return []
        if not self.workers:  # the replacements load it when admitted
            self.admit_started(wait=True)
        return self.load_times(wait=True)

    def load_times(self, wait: bool = False) -> list[float]:
        """Milliseconds of each adapter load confirmed since the last call (`wait`: all pending),
        by worker slot."""
        self._take_loads(wait)
        times, self.load_ms = sorted(self.load_ms), []
        return [ms for _, ms in times]

    def _take_loads(self, wait: bool) -> None:
        while self.pending_loads:
            done, _ = ray.wait(list(self.pending_loads), num_returns=len(self.pending_loads) if wait else 1,
                               timeout=None if wait else 0)
            if not done:
                return
            for ref in done:
                slot = self.pending_loads.pop(ref)
                try:
                    loaded: AdapterLoaded = ray.get(ref)
                except DEAD_WORKER as error:
                    self._worker_died(slot, error)
                    continue
                except ray.exceptions.RayTaskError as error:
                    raise QerlError(f"rollout worker {slot} could not load the adapter: {root_cause(error)}") from None
                self.state.adapter_version = max(self.state.adapter_version, loaded.version)
                self.load_ms.append((slot, loaded.load_ms))

    def shutdown(self) -> None:
        actors = [*self.workers.values(), *(actor for actor, _ in self.starting.values())]
        stopping = [actor.shutdown.remote() for actor in actors]  # all at once
        for actor, ref in zip(actors, stopping):
            _stop_actor(actor, ref)
        self.workers, self.starting, self.running, self.queue = {}, {}, {}, []


def _stop_actor(actor, stopping: ray.ObjectRef | None = None) -> None:
    """Shut the worker's engine down (so nothing is left in /dev/shm), then end its process."""
    try:
        ray.get(stopping if stopping is not None else actor.shutdown.remote(), timeout=SHUTDOWN_WAIT_S)
    except (DEAD_WORKER, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError):
        pass
    ray.kill(actor)


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

"""`qerl train`: the QeRL loop, one plain function that reads top to bottom.

Each step, in named parts: `fleet_control` (a `qerl scale` request resizes the rollout fleet)
-> `collect` (the step's prompts on the rollout workers, vLLM with the current adapter and the
step's AQN noise on its RMSNorm, n completions per prompt, scored; under DAPO's dynamic
sampling, groups with no reward spread are dropped and refilled; deploy/rollouts.py) ->
`learn` (the learner's optimizer steps: 4-bit base + LoRA, truncated importance weights against
the rollout logprobs, group-normalised advantages) -> `sync` (the new adapter through the object
store into every worker, from memory) -> `step_record` (one metrics line), then the optional
evaluation and checkpoint. With rollout.max_staleness k > 0 the next k steps' batches are
generating while the learner trains. `qerl train --resume RUN_DIR` picks a run up at its last
checkpoint; SIGINT/SIGTERM stop it at the end of the current step with a checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from random import Random

import ray
import torch
import yaml

from deploy.checkpoint import (
    complete_checkpoints,
    newest_intact_checkpoint,
    periodic_save_due,
    remove_partial_checkpoints,
    steps_done,
    write_checkpoint,
)
from deploy.evaluate import EVAL_SEED_OFFSET, evaluate, format_eval_line
from deploy.fleet_control import ControlChannel
from deploy.ray_cluster import check_run_dir_for_job, connect_ray
from deploy.rollouts import Rollouts, RolloutsAhead, collect, staleness_metrics, training_samples
from deploy.run_builder import prepare_run, start_learner, start_pool
from deploy.run_folder import (
    RunLock,
    discard_previous_run,
    make_run_dir,
    move_previous_run_aside,
    remove_if_empty,
    restore_previous_run,
)
from learner.model import resolve_model_path
from rollout_server.pool import RolloutPool, gpu_memory_note, root_cause
from shared.config import QerlConfig, load_config
from shared.errors import QerlError
from shared.metrics import (
    MetricsWriter,
    check_tensorboard,
    format_step_line,
    read_metrics,
    read_resumable_metrics,
    reward_trend_line,
)
from shared.prompts import PromptEncoder
from shared.scoring import Scorer
from shared.tasks import Problem, Task
from shared.types import TrainSample

# Settings a resumed run may change: how many steps, how often to save, evaluate and log, and
# where the actors run. Anything else would make the resumed run another run.
RESUMABLE_OVERRIDES = ("train.steps", "train.eval_every", "train.tensorboard", "checkpoint.", "ray.",
                       "rollout.num_workers", "rollout.num_cpus_per_worker", "rollout.num_gpus_per_worker",
                       "learner.num_cpus", "learner.num_gpus")


def run_identity(config: QerlConfig, model_path: str) -> dict:
    """What a checkpoint must share with the run that resumes it. The embedded model is named by
    what it is (its recipe's hash), not where QERL_CACHE_DIR put it."""
    model = f"embedded {Path(model_path).name}" if config.model.path is None else model_path
    return {"model": model, "policy": config.policy.format, "lora_rank": config.lora.rank,
            "lora_alpha": config.lora.alpha, "lora_targets": config.lora.target_modules}


@dataclass
class Run:
    """The live pieces of a training run: actors, task, prompt encoder, scorer, output folder."""

    config: QerlConfig
    run_dir: Path
    task: Task
    prompts: PromptEncoder
    scorer: Scorer
    learner: ray.actor.ActorHandle
    pool: RolloutPool
    started_ray: bool
    identity: dict
    control: ControlChannel
    eval_problems: list[Problem] = field(default_factory=list)

    @property
    def tokenizer(self):
        return self.prompts.tokenizer

    def close(self) -> None:
        self.scorer.close()
        self.control.close()
        self.pool.shutdown()
        ray.kill(self.learner)
        if self.started_ray:
            ray.shutdown()


def start_run(config: QerlConfig, log=print, resuming: bool = False) -> Run:
    """Check the inputs, start (or join) Ray, create the learner and the rollout workers."""
    check_run_dir_for_job(config.train.run_dir)
    run_dir = Path(config.train.run_dir).resolve()
    if not resuming and (run_dir / "metrics.jsonl").exists() and not config.train.overwrite:
        raise QerlError(f"{run_dir} already holds a run; pick another train.run_dir, set train.overwrite=true "
                        f"or continue it with qerl train --resume {run_dir}")
    if config.train.tensorboard:
        check_tensorboard()
    prepared = prepare_run(config, log)  # every check that needs no actor: before any engine starts
    for warning in config.warnings():
        log(f"[qerl] warning: {warning}")
    eval_problems = prepared.task.held_out(config.train.eval_problems) if config.train.eval_every else []
    make_run_dir(run_dir)
    started_ray = connect_ray(config, log)
    try:
        log_dir = None if config.ray.log_to_driver else str(run_dir / "logs")
        if config.train.overwrite and not resuming:  # kept aside until the new run's first checkpoint
            move_previous_run_aside(run_dir)
        learner, info = start_learner(config, prepared.model_path, str(run_dir), log_dir)
        if not resuming:  # a resumed run's, once its checkpoint has loaded
            write_run_config(run_dir, config)
        log(f"[qerl] learner ready ({config.policy.format}: {info['summary']}{gpu_memory_note(info)})")
        if info["compiled_layers"]:  # else a silent first step of minutes looks like a hang
            log(f"[qerl] the learner's first step also compiles its {info['compiled_layers']} decoder layers' "
                f"graph (minutes on a large model, once; learner.compile_layers=false "
                f"skips it)")
        pool = start_pool(config, info, config.lora.rank, log, log_dir)
        control = ControlChannel(run_dir)
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    scorer = Scorer(prepared.grade, config.task.reward_timeout_s, config.task.reward_threads, log)
    return Run(config, run_dir, prepared.task, prepared.prompts, scorer, learner, pool, started_ray,
               run_identity(config, prepared.model_path), control, eval_problems)


def write_run_config(run_dir: Path, config: QerlConfig) -> None:
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))


def train(config: QerlConfig, log=print) -> dict:
    """Run the configured training; returns the last step's metrics plus the output paths. The run
    folder is locked for the driver's life; an overwritten run comes back if this one fails before
    its first checkpoint."""
    check_run_dir_for_job(config.train.run_dir)
    run_dir = Path(config.train.run_dir).resolve()
    created = not run_dir.exists()
    lock = RunLock(make_run_dir(run_dir))
    try:
        run = start_run(config, log)
        try:
            return train_loop(run, 0, Random(config.train.seed), log)
        finally:
            run.close()
    except BaseException:
        if config.train.overwrite and restore_previous_run(run_dir):
            log(f"[qerl] the new run failed before its first checkpoint; the previous run in {run_dir} is restored")
        raise
    finally:
        lock.release()
        if created:
            remove_if_empty(run_dir)


def resume(run_dir: str, overrides: list[str], log=print) -> dict:
    """Continue the run in `run_dir` from its newest complete checkpoint."""
    folder = Path(run_dir).resolve()
    saved_config = folder / "config.yaml"
    if not saved_config.is_file():
        raise QerlError(f"{folder} holds no run to resume (no config.yaml)")
    lock = RunLock(folder)
    try:
        return _resume_locked(folder, overrides, log)
    finally:
        lock.release()


def _resume_locked(folder: Path, overrides: list[str], log) -> dict:
    saved_config = folder / "config.yaml"
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if not any(key == allowed or (allowed.endswith(".") and key.startswith(allowed))
                   for allowed in RESUMABLE_OVERRIDES):
            raise QerlError(f"--resume: {key} would change the run's meaning; a resumed run may change only "
                            f"{', '.join(RESUMABLE_OVERRIDES)}")
    saved = load_config(saved_config, overrides)
    config = saved.model_copy(update={"train": saved.train.model_copy(update={"run_dir": str(folder)})})
    checkpoint, files = newest_intact_checkpoint(folder, log)  # verified before anything starts
    driver = json.loads(files["driver.json"])
    identity = run_identity(config, resolve_model_path(config.model.path, log=lambda *_: None))
    if _saved_identity(driver["identity"], config) != identity:
        differs = ", ".join(k for k in identity if driver["identity"].get(k) != identity[k])
        raise QerlError(f"checkpoint {checkpoint} belongs to another run ({differs} differ from {saved_config})")
    done = steps_done(checkpoint)
    if done >= config.train.steps:
        raise QerlError(f"{folder} already ran its {config.train.steps} steps; raise train.steps to go on")
    _, torn = read_resumable_metrics(folder / "metrics.jsonl")  # a bad line refused before engines start
    if torn:
        log(f"[qerl] note: the last line of {folder / 'metrics.jsonl'} is incomplete (an interrupted write); "
            f"it is dropped")
    remove_partial_checkpoints(folder)
    run = start_run(config, log, resuming=True)
    try:
        try:
            ray.get(run.learner.load_checkpoint_files.remote(files))
        except ray.exceptions.RayTaskError as error:
            raise QerlError(f"checkpoint {checkpoint} does not fit this model: {error.cause}") from None
        run.pool.update_adapter(run.learner.export_adapter.remote())
        write_run_config(folder, saved)  # with the new overrides, now that the checkpoint has loaded
        _keep_metrics_before(folder / "metrics.jsonl", done)
        rng = Random()
        state = driver["sampler_state"]
        rng.setstate((state[0], tuple(state[1]), state[2]))
        log(f"[qerl] resuming {folder} after step {done - 1} from {checkpoint.name}")
        return train_loop(run, done, rng, log)
    finally:
        run.close()


def _saved_identity(saved: dict, config: QerlConfig) -> dict:
    """A checkpoint's identity as run_identity writes it now (older ones held the embedded
    model's absolute cache path)."""
    model = saved.get("model")
    if config.model.path is None and isinstance(model, str) and Path(model).name.startswith("tiny-qwen2-"):
        return {**saved, "model": f"embedded {Path(model).name}"}
    return saved


def _keep_metrics_before(path: Path, step: int) -> None:
    """Drop the metrics lines of steps the checkpoint does not cover (a killed run may have
    logged a step after its last checkpoint); rewritten atomically."""
    if not path.exists():
        return
    kept = [json.dumps(record) for record in read_resumable_metrics(path)[0] if record["step"] < step]
    temporary = path.with_suffix(".tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)


def learn(run: Run, step: int, samples: list[TrainSample]) -> dict[str, float]:
    """The learner's optimizer steps; the fleet keeps generating batches submitted ahead meanwhile."""
    if not samples:  # dynamic sampling found no group with a reward spread: nothing to train
        version = run.pool.state.adapter_version
        return {"learner/skipped_steps": 0.0, "learner/tokens": 0.0, "learner/version": float(version),
                "learner/empty_step": 1.0, "async/overlap": 0.0}
    try:
        stats, overlap = run.pool.wait_for(run.learner.train_step.remote(samples, run.config.rollout.temperature))
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as error:  # e.g. out of GPU memory
        raise QerlError(f"the learner failed in step {step}: {root_cause(error)}") from None
    return {**stats, "async/overlap": overlap}


def sync(run: Run, version: int) -> dict[str, float]:
    """The learner's new adapter into every worker, from memory. Synchronous: confirmed before
    the next step. With batches ahead: a worker loads it after the chunk it is generating."""
    if version <= run.pool.state.adapter_version:
        # the learner did not step (nothing to train, or a non-finite loss): the workers hold this
        # adapter already, and version 0 (the untrained start) is no adapter vLLM can load
        return {"sync/adapter_ms": 0.0, "sync/worker_load_ms_max": 0.0}
    started = time.perf_counter()
    synchronous = run.config.rollout.max_staleness == 0
    worker_ms = run.pool.update_adapter(run.learner.export_adapter.remote(), version=version, wait=synchronous)
    if not synchronous:
        worker_ms = run.pool.load_times()  # the loads confirmed by now (this push's or earlier ones)
    return {"sync/adapter_ms": (time.perf_counter() - started) * 1e3,
            "sync/worker_load_ms_max": max(worker_ms, default=0.0)}


def step_record(step: int, rollouts: Rollouts, learner_stats: dict, sync_stats: dict, fleet: dict,
                step_s: float, max_staleness: int) -> dict:
    """The step's metrics; rollout/* describe the first generate call (the policy as sampled)."""
    completions = [c for g in rollouts.first_call for c in g.completions]
    rewards = torch.tensor([r for g in rollouts.first_call for r in g.rewards])
    solved = torch.tensor([[r >= 1.0 for r in g.rewards] for g in rollouts.first_call])
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "step": step,
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/accuracy": solved.float().mean().item(),
        "rollout/pass_at_n": solved.any(dim=1).float().mean().item(),
        "rollout/tokens": generated,
        "rollout/tok_per_s": generated / max(rollouts.generation_s, 1e-9),
        "rollout/truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "rollout/reward_errors": rollouts.reward_errors,
        "rollout/reward_timeouts": rollouts.reward_timeouts,
        **{f"reward/{name}": value for name, value in rollouts.reward_parts.items()},
        "rollout/generate_calls": rollouts.generate_calls,
        "rollout/groups_dropped": rollouts.groups_dropped,
        "rollout/groups_trained": len(rollouts.groups),
        "aqn/sigma": rollouts.sigma,
        **sync_stats,
        **fleet,
        "adapter/version": max(c.adapter_version for c in completions),
        "adapter/version_min": min(c.adapter_version for c in completions),
        **staleness_metrics(rollouts, max_staleness),
        **learner_stats,
        "time/rollout_s": rollouts.seconds,
        "time/step_s": step_s,
    }


def save_checkpoint(run: Run, steps: int, sampler_state: tuple, sigma: float) -> Path:
    """The learner's files and the driver's state, written atomically by the driver."""
    files = ray.get(run.learner.checkpoint_files.remote())
    version = ray.get(run.learner.adapter_version.remote())
    driver = {"steps_done": steps, "adapter_version": version, "sigma": sigma, "identity": run.identity,
              "sampler_state": [sampler_state[0], list(sampler_state[1]), sampler_state[2]]}
    files["driver.json"] = json.dumps(driver).encode()
    folder = write_checkpoint(run.run_dir, steps, files, run.config.checkpoint.keep)
    discard_previous_run(run.run_dir)  # an overwritten run goes once this one can be resumed
    return folder


class StopOnSignal:
    """SIGINT/SIGTERM ask the loop to stop at the end of the current step (with a checkpoint);
    a second signal stops at once."""

    def __init__(self, log):
        self.log, self.signal_name, self._previous = log, None, {}

    def __enter__(self) -> StopOnSignal:
        for number in (signal.SIGINT, signal.SIGTERM):
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number, frame) -> None:
        if self.signal_name is not None:
            raise KeyboardInterrupt(signal.Signals(number).name)
        self.signal_name = signal.Signals(number).name
        self.log(f"[qerl] {self.signal_name}: stopping after this step (send it again to stop at once)")


def train_loop(run: Run, start_step: int, rng: Random, log=print) -> dict:
    config = run.config
    metrics = MetricsWriter(run.run_dir / "metrics.jsonl")
    tensorboard = _tensorboard(run) if config.train.tensorboard else None
    ahead_by = config.rollout.max_staleness
    ahead = RolloutsAhead(run, rng, start_step)
    record: dict = {}
    bad_in_a_row, step, sigma = 0, start_step, 0.0
    empty_steps = _empty_steps_before(metrics.path)
    last_save = time.monotonic()
    try:
        with StopOnSignal(log) as stop:
            for step in range(start_step, config.train.steps):
                started = time.perf_counter()
                fleet_control(run, step)  # a `qerl scale` request takes effect at the step boundary
                ahead.submit_through(step + ahead_by)
                rollouts = collect(run, step, ahead)
                sigma = rollouts.sigma
                samples = training_samples(rollouts.groups, config.rollout.samples_per_prompt,
                                           rollouts.learner_version)
                learner_stats = learn(run, step, samples)
                sync_stats = sync(run, int(learner_stats["learner/version"]))
                step_s = time.perf_counter() - started
                busy_window = step_s if ahead_by else rollouts.generation_s  # a worker's busy fraction of it
                fleet = run.pool.fleet_metrics() | run.pool.worker_metrics(busy_window)
                record = step_record(step, rollouts, learner_stats, sync_stats, fleet, step_s, ahead_by)
                bad_in_a_row = bad_in_a_row + 1 if learner_stats["learner/skipped_steps"] else 0
                if learner_stats.get("learner/empty_step"):
                    empty_steps += 1
                    log(f"[qerl] step {step}: no group with a reward spread after {rollouts.generate_calls} "
                        f"generate call(s): nothing to train, learner step skipped ({empty_steps} so far)")
                record["learner/empty_steps"] = empty_steps
                if bad_in_a_row:
                    log(f"[qerl] step {step}: non-finite loss or gradients, optimizer step skipped "
                        f"({bad_in_a_row} in a row)")
                last = step + 1 == config.train.steps
                if config.train.eval_every and ((step + 1) % config.train.eval_every == 0 or last):
                    record |= evaluate(run.pool, run.prompts, run.task, run.eval_problems, config,
                                       seed=config.train.seed + EVAL_SEED_OFFSET + step)
                    run.pool.discard_worker_stats()  # the fleet/worker* metrics count training rollouts
                metrics.write(record)
                if tensorboard:
                    tensorboard.write(record)
                log(format_step_line(record))
                if "eval/accuracy" in record:
                    log(format_eval_line(record))
                if bad_in_a_row >= config.learner.max_bad_steps:
                    kept = complete_checkpoints(run.run_dir)
                    raise QerlError(f"non-finite loss or gradients in {bad_in_a_row} steps in a row (learner."
                                    f"max_bad_steps); stopped. Last good checkpoint: "
                                    f"{kept[-1] if kept else 'none'}")
                periodic = periodic_save_due(config.checkpoint.every, config.checkpoint.minutes, step + 1,
                                             time.monotonic() - last_save)
                if not bad_in_a_row and (last or stop.signal_name or periodic):
                    save_checkpoint(run, step + 1, ahead.sampler_state_after(step), sigma)
                    last_save = time.monotonic()
                if stop.signal_name and not last:
                    raise Stopped(stop.signal_name, step, run.run_dir)
        final_adapter = ray.get(run.learner.save_adapter.remote(str(run.run_dir / "final_adapter")))
    finally:
        metrics.close()
        if tensorboard:
            tensorboard.close()
    log(reward_trend_line(read_metrics(metrics.path)))
    log(f"[qerl] metrics: {metrics.path}\n[qerl] final adapter (peft folder): {final_adapter}")
    return {**record, "run_dir": str(run.run_dir), "final_adapter": final_adapter}


def _empty_steps_before(path: Path) -> int:
    """Steps with nothing to train that a resumed run already logged (the count goes on)."""
    return int(read_metrics(path)[-1].get("learner/empty_steps", 0)) if path.exists() and path.stat().st_size else 0


def fleet_control(run: Run, step: int) -> None:
    """Publish the fleet's state for `qerl scale` and apply a request it left."""
    rollout = run.config.rollout
    status = {"step": step, "workers": len(run.pool.live()), "target": run.pool.target,
              "cpus_per_worker": rollout.num_cpus_per_worker, "gpus_per_worker": rollout.num_gpus_per_worker,
              "placement_timeout_s": run.config.ray.placement_timeout_s, "local_ray": run.started_ray}
    requested = run.control.exchange(status)
    if requested is not None and requested != run.pool.target:
        run.pool.scale(requested)


class Stopped(Exception):
    """A signal stopped the run after a checkpoint; `qerl train --resume` continues it."""

    def __init__(self, signal_name: str, step: int, run_dir: Path):
        super().__init__(f"{signal_name}: stopped after step {step} with a checkpoint; continue with "
                         f"qerl train --resume {run_dir}")
        self.exit_code = 128 + signal.Signals[signal_name].value


def _tensorboard(run: Run):
    from shared.metrics import TensorBoardWriter

    return TensorBoardWriter(run.run_dir / "tensorboard")

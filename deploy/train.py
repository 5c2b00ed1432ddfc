"""`qerl train`: the QeRL loop, one plain function that reads top to bottom.

Each step, in named parts: `collect` (AQN sigma -> rollout workers, vLLM with the current
adapter and noised RMSNorm, sample n completions per prompt) -> `score` (task rewards,
group-normalised advantages) -> `learn` (the learner's optimizer steps: NF4 base + LoRA,
truncated importance weights against the rollout logprobs) -> `sync` (the new adapter through
the object store into every worker, from memory) -> `step_record` (one metrics line).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from random import Random

import ray
import torch
import yaml

from deploy.ray_cluster import connect_ray
from learner.actor import LearnerActor, LearnerSpec
from learner.losses import group_advantages
from learner.model import check_model_folder
from rollout_server.pool import RolloutPool, gpu_memory_note, ready_or_error
from rollout_server.vllm_internals import serving_problem
from shared.aqn import aqn_sigma
from shared.config import QerlConfig
from shared.errors import QerlError
from shared.metrics import MetricsWriter, format_step_line, read_metrics, reward_trend_line
from shared.tasks import Problem, Task, build_task
from shared.types import Completion, SamplingSettings, TrainSample


def resolve_model_path(config: QerlConfig, log=print) -> str:
    if config.model.path is None:
        from shared.tiny_model import tiny_model_path, tiny_model_report

        path = tiny_model_path(log=log)
        accuracy = tiny_model_report(path)["greedy_accuracy"]
        log(f"[qerl] embedded tiny model {path.name}: starting greedy accuracy {accuracy:.0%}")
        return str(path)
    return str(check_model_folder(config.model.path).resolve())


@dataclass
class Run:
    """The live pieces of a training run: actors, task, tokenizer, output folder."""

    config: QerlConfig
    run_dir: Path
    task: Task
    tokenizer: object
    learner: ray.actor.ActorHandle
    pool: RolloutPool
    started_ray: bool

    def close(self) -> None:
        self.pool.shutdown()
        ray.kill(self.learner)
        if self.started_ray:
            ray.shutdown()


def start_run(config: QerlConfig, log=print) -> Run:
    """Check the inputs, start (or join) Ray, create the learner and the rollout workers."""
    run_dir = Path(config.train.run_dir).resolve()
    if (run_dir / "metrics.jsonl").exists() and not config.train.overwrite:
        raise QerlError(f"{run_dir} already holds a run; pick another train.run_dir or set train.overwrite=true")
    task = build_task(config.task)
    problem = serving_problem(config.policy.format, config.rollout)
    if problem:  # before any engine starts
        raise QerlError(problem)
    model_path = resolve_model_path(config, log)
    run_dir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    started_ray = connect_ray(config)
    try:
        spec = LearnerSpec(model_path, config.lora, config.learner, str(run_dir), config.policy, config.engine_dtype(),
                           config.train.seed, "cuda" if config.learner.num_gpus > 0 else "cpu")
        learner = ray.remote(LearnerActor).options(
            num_cpus=config.learner.num_cpus, num_gpus=config.learner.num_gpus
        ).remote(spec)
        info = ready_or_error(learner, "the learner")
        # the new run's model has loaded: only now do the previous run's outputs go
        if config.train.overwrite:
            _remove_run_outputs(run_dir)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
        log(f"[qerl] learner ready ({config.policy.format}: {info['summary']}{gpu_memory_note(info)})")
        pool = RolloutPool(info["served"], config.rollout, config.lora.rank, log=log)
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    return Run(config, run_dir, task, tokenizer, learner, pool, started_ray)


def _remove_run_outputs(run_dir: Path) -> None:
    """The previous run's metrics and final adapter (rollout_base/ is the new run's by now)."""
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "final_adapter", ignore_errors=True)


def train(config: QerlConfig, log=print) -> dict:
    """Run the configured training; returns the last step's metrics plus the output paths."""
    run = start_run(config, log)
    try:
        return train_loop(run, log)
    finally:
        run.close()


@dataclass
class Rollouts:
    """One step's sampled batch: the problems, their prompt ids and every completion."""

    problems: list[Problem]
    prompt_ids: list[list[int]]
    completions: list[Completion]
    sigma: float
    seconds: float


@dataclass
class Scored:
    rewards: torch.Tensor
    """[prompts * n], in completion order."""
    samples: list[TrainSample]


def collect(run: Run, step: int, rng: Random) -> Rollouts:
    """Set this step's AQN noise, sample prompts and generate n completions for each."""
    config = run.config
    sigma = aqn_sigma(config.aqn, step, config.train.steps)
    run.pool.set_noise(sigma, seed=config.train.seed * 1_000_003 + step)
    problems = run.task.sample(rng, config.train.prompts_per_step)
    prompt_ids = run.tokenizer([p.prompt for p in problems], add_special_tokens=False)["input_ids"]
    sampling = SamplingSettings(config.rollout.samples_per_prompt, config.rollout.temperature,
                                config.rollout.max_new_tokens, seed=config.train.seed * 1_000_003 + step * 101)
    started = time.perf_counter()
    completions = run.pool.generate(prompt_ids, sampling)
    return Rollouts(problems, prompt_ids, completions, sigma, time.perf_counter() - started)


def score(run: Run, rollouts: Rollouts) -> Scored:
    """Task rewards, group-normalised advantages and the learner's samples."""
    texts = run.tokenizer.batch_decode([c.token_ids for c in rollouts.completions], skip_special_tokens=True)
    problems = rollouts.problems
    rewards = torch.tensor([run.task.reward(problems[c.prompt_index], t) for c, t in zip(rollouts.completions, texts)])
    advantages = group_advantages(rewards.view(len(problems), run.config.rollout.samples_per_prompt)).flatten()
    samples = [
        TrainSample(rollouts.prompt_ids[c.prompt_index], c.token_ids, c.logprobs, float(a))
        for c, a in zip(rollouts.completions, advantages)
    ]
    return Scored(rewards, samples)


def learn(run: Run, scored: Scored) -> dict[str, float]:
    return ray.get(run.learner.train_step.remote(scored.samples, run.config.rollout.temperature))


def sync(run: Run) -> dict[str, float]:
    """The learner's new adapter into every worker, from memory."""
    started = time.perf_counter()
    worker_ms = run.pool.update_adapter(run.learner.export_adapter.remote())
    return {"sync/adapter_ms": (time.perf_counter() - started) * 1e3, "sync/worker_load_ms_max": max(worker_ms)}


def step_record(step: int, rollouts: Rollouts, scored: Scored, learner_stats: dict, sync_stats: dict,
                step_s: float, n: int) -> dict:
    completions, rewards = rollouts.completions, scored.rewards
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "step": step,
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/accuracy": (rewards >= 1.0).float().mean().item(),
        "rollout/pass_at_n": (rewards.view(-1, n).max(1).values >= 1.0).float().mean().item(),
        "rollout/tokens": generated,
        "rollout/tok_per_s": generated / rollouts.seconds,
        "rollout/truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "aqn/sigma": rollouts.sigma,
        **sync_stats,
        "adapter/version": completions[0].adapter_version,
        **learner_stats,
        "time/rollout_s": rollouts.seconds,
        "time/step_s": step_s,
    }


def train_loop(run: Run, log=print) -> dict:
    metrics = MetricsWriter(run.run_dir / "metrics.jsonl")
    rng = Random(run.config.train.seed)
    record: dict = {}
    try:
        for step in range(run.config.train.steps):
            started = time.perf_counter()
            rollouts = collect(run, step, rng)
            scored = score(run, rollouts)
            learner_stats = learn(run, scored)
            sync_stats = sync(run)
            record = step_record(step, rollouts, scored, learner_stats, sync_stats, time.perf_counter() - started,
                                 run.config.rollout.samples_per_prompt)
            metrics.write(record)
            log(format_step_line(record))
        final_adapter = ray.get(run.learner.save_adapter.remote(str(run.run_dir / "final_adapter")))
    finally:
        metrics.close()
    log(reward_trend_line(read_metrics(metrics.path)))
    log(f"[qerl] metrics: {metrics.path}\n[qerl] final adapter (peft folder): {final_adapter}")
    return {**record, "run_dir": str(run.run_dir), "final_adapter": final_adapter}

"""Evaluation through the rollout engines: greedy accuracy and pass@k on held-out problems.

`evaluate` runs on a live pool (during training, with the current adapter); `qerl eval` starts
a pool for a saved adapter (a peft folder, a run's final adapter or its latest checkpoint)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import ray

from shared.config import QerlConfig, load_config
from shared.errors import QerlError
from shared.tasks import Problem, Task, build_task
from shared.types import AdapterUpdate, SamplingSettings

EVAL_SEED_OFFSET = 7_777_777  # eval draws never share seeds with training steps
EVAL_ORDER = -1  # the work queue serves an evaluation before training batches submitted ahead


def evaluate(pool, tokenizer, task: Task, problems: list[Problem], config: QerlConfig, seed: int) -> dict[str, float]:
    """eval/accuracy (greedy), eval/sampled_accuracy and eval/pass_at_k over `problems`, with the
    pool's current adapter and no AQN noise."""
    prompt_ids = tokenizer([p.prompt for p in problems], add_special_tokens=False)["input_ids"]
    max_new = config.rollout.max_new_tokens
    k = config.train.eval_samples
    # ahead of any training batch in the queue; the batches carry no AQN noise
    greedy = pool.generate(prompt_ids, SamplingSettings(1, 0.0, max_new, seed=seed), order=EVAL_ORDER)
    sampled = pool.generate(prompt_ids, SamplingSettings(k, config.rollout.temperature, max_new, seed=seed + 1),
                            order=EVAL_ORDER)
    correct = _correct(tokenizer, task, problems, greedy)
    sampled_correct = _correct(tokenizer, task, problems, sampled)
    by_problem = [[] for _ in problems]
    for completion, ok in zip(sampled, sampled_correct):
        by_problem[completion.prompt_index].append(ok)
    return {
        "eval/accuracy": sum(correct) / len(correct),
        "eval/sampled_accuracy": sum(sampled_correct) / len(sampled_correct),
        "eval/pass_at_k": sum(any(row) for row in by_problem) / len(by_problem),
        "eval/k": float(k),
        "eval/problems": float(len(problems)),
    }


def _correct(tokenizer, task: Task, problems: list[Problem], completions) -> list[bool]:
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    return [_safe_reward(task, problems[c.prompt_index], text) >= 1.0 for c, text in zip(completions, texts)]


def _safe_reward(task: Task, problem: Problem, text: str) -> float:
    try:
        return task.reward(problem, text)
    except Exception:  # a reward function's failure scores the sample 0 (train counts them)
        return 0.0


def held_out_problems(config: QerlConfig) -> list[Problem]:
    problems = build_task(config.task).held_out(config.train.eval_problems)
    if not problems:
        raise QerlError("the task has no held-out problems to evaluate on")
    return problems


def read_adapter_folder(folder: Path, dtype) -> tuple[AdapterUpdate, int]:
    """A peft adapter folder (safetensors only) as an adapter update, and its rank."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from shared.adapter_payload import encode_adapter

    config_path, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file():
        raise QerlError(f"{folder} is not a peft adapter folder (no adapter_config.json)")
    if not weights.is_file():
        pickled = folder / "adapter_model.bin"
        why = " (adapter_model.bin is a pickle file: qerl loads safetensors only)" if pickled.exists() else ""
        raise QerlError(f"{folder} has no adapter_model.safetensors{why}")
    try:
        peft_config = json.loads(config_path.read_text())
        rank = int(peft_config["r"])
    except (ValueError, KeyError, TypeError) as error:
        raise QerlError(f"{config_path} is not a valid adapter config ({error})") from None
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as error:
        raise QerlError(f"{weights} cannot be read as safetensors ({error})") from None
    return AdapterUpdate(version=1, payload=encode_adapter(tensors, dtype), peft_config=peft_config), rank


def eval_adapter_folder(target: str | None, adapter: str | None) -> Path:
    """The adapter `qerl eval` scores: --adapter, else the run's final adapter, else the
    adapter of its latest checkpoint."""
    from deploy.checkpoint import latest_checkpoint

    if adapter:
        return Path(adapter)
    run_dir = Path(target)
    if (run_dir / "final_adapter").is_dir():
        return run_dir / "final_adapter"
    return latest_checkpoint(run_dir) / "adapter"


def eval_config(run_dir: str | None, config_path: str | None, overrides: list[str]) -> QerlConfig:
    if run_dir is not None:
        saved = Path(run_dir) / "config.yaml"
        if not saved.is_file():
            raise QerlError(f"{run_dir} holds no run (no config.yaml)")
        return load_config(saved, overrides)
    return load_config(config_path, overrides)


def run_eval(config: QerlConfig, adapter_folder: Path, log=print) -> dict[str, float]:
    """Start a learner (only to write the base the engines serve) and a pool, load the
    adapter, evaluate, stop everything."""
    from transformers import AutoTokenizer

    from deploy.adapter_fit import check_adapter_fits
    from deploy.ray_cluster import connect_ray
    from deploy.train import resolve_model_path
    from learner.actor import LearnerActor, LearnerSpec
    from rollout_server.pool import RolloutPool, ready_or_error
    from rollout_server.vllm_internals import serving_problem
    from shared.formats import dtype_of

    problem = serving_problem(config.policy.format, config.rollout)
    if problem:
        raise QerlError(problem)
    update, rank = read_adapter_folder(adapter_folder, dtype_of(config.engine_dtype()))
    problems = held_out_problems(config)
    task = build_task(config.task)
    model_path = resolve_model_path(config, log)
    check_adapter_fits(adapter_folder, model_path)  # vLLM would score a misfit adapter without a word
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    started_ray = connect_ray(config, log)
    learner, pool = None, None
    try:
        with tempfile.TemporaryDirectory(prefix="qerl-eval-") as scratch:
            spec = LearnerSpec(model_path, config.lora.model_copy(update={"rank": rank}), config.learner, scratch,
                               config.policy, config.engine_dtype(), config.train.seed,
                               "cuda" if config.learner.num_gpus > 0 else "cpu")
            learner = ray.remote(LearnerActor).options(num_cpus=config.learner.num_cpus,
                                                       num_gpus=config.learner.num_gpus).remote(spec)
            info = ready_or_error(learner, "the learner")
            pool = RolloutPool(info["served"], config.engine_rollout(), rank, log=log)
            try:
                pool.update_adapter(update)
            except ray.exceptions.RayError as error:
                raise QerlError(f"adapter {adapter_folder} does not fit the model {model_path}: "
                                f"{str(error).strip().splitlines()[-1]}") from None
            log(f"[qerl] evaluating {adapter_folder} on {len(problems)} held-out problems")
            return evaluate(pool, tokenizer, task, problems, config, seed=config.train.seed + EVAL_SEED_OFFSET)
    finally:
        if pool is not None:
            pool.shutdown()
        if learner is not None:
            ray.kill(learner)
        if started_ray:
            ray.shutdown()


def format_eval_line(record: dict[str, float]) -> str:
    return (f"[qerl] eval: greedy accuracy {record['eval/accuracy']:.3f}, sampled accuracy "
            f"{record['eval/sampled_accuracy']:.3f}, pass@{record['eval/k']:.0f} {record['eval/pass_at_k']:.3f} "
            f"({record['eval/problems']:.0f} held-out problems)")

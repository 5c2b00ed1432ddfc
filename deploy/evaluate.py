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
from shared.prompts import PromptEncoder
from shared.scoring import Scorer
from shared.tasks import Problem, Task
from shared.types import AdapterUpdate, SamplingSettings

EVAL_SEED_OFFSET = 7_777_777  # eval draws never share seeds with training steps
EVAL_ORDER = -1  # the work queue serves an evaluation before training batches submitted ahead


def evaluate(pool, prompts: PromptEncoder, task: Task, problems: list[Problem], config: QerlConfig,
             seed: int) -> dict[str, float]:
    """eval/accuracy (greedy), eval/sampled_accuracy and eval/pass_at_k over `problems`, with the
    pool's current adapter and no AQN noise. Graded by the task's own grade (not task.reward):
    accuracy means correct answers."""
    prompt_ids = prompts.encode([p.prompt for p in problems])
    max_new = config.rollout.max_new_tokens
    k = config.train.eval_samples
    # ahead of any training batch in the queue; the batches carry no AQN noise
    greedy = pool.generate(prompt_ids, SamplingSettings(1, 0.0, max_new, seed=seed), order=EVAL_ORDER)
    sampled = pool.generate(prompt_ids, SamplingSettings(k, config.rollout.temperature, max_new, seed=seed + 1),
                            order=EVAL_ORDER)
    scorer = Scorer(task.reward, config.task.reward_timeout_s, config.task.reward_threads)
    try:
        correct, greedy_errors = _correct(scorer, prompts.tokenizer, problems, greedy, pool)
        sampled_correct, sampled_errors = _correct(scorer, prompts.tokenizer, problems, sampled, pool)
    finally:
        scorer.close()
    by_problem = [[] for _ in problems]
    for completion, ok in zip(sampled, sampled_correct):
        by_problem[completion.prompt_index].append(ok)
    return {
        "eval/accuracy": sum(correct) / len(correct),
        "eval/sampled_accuracy": sum(sampled_correct) / len(sampled_correct),
        "eval/pass_at_k": sum(any(row) for row in by_problem) / len(by_problem),
        "eval/k": float(k),
        "eval/problems": float(len(problems)),
        "eval/reward_errors": float(greedy_errors + sampled_errors),
    }


def _correct(scorer: Scorer, tokenizer, problems: list[Problem], completions, pool) -> tuple[list[bool], int]:
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    scores = scorer.score([problems[c.prompt_index] for c in completions], texts, keep_busy=pool.pump_once)
    return [reward >= 1.0 for reward in scores.rewards], scores.errors


def held_out_problems(task: Task, config: QerlConfig) -> list[Problem]:
    problems = task.held_out(config.train.eval_problems)
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
    from deploy.adapter_fit import check_adapter_fits
    from deploy.ray_cluster import connect_ray
    from deploy.run_builder import prepare_run, start_learner, start_pool
    from shared.formats import dtype_of

    update, rank = read_adapter_folder(adapter_folder, dtype_of(config.engine_dtype()))  # bad input first
    prepared = prepare_run(config, log)
    problems = held_out_problems(prepared.task, config)
    check_adapter_fits(adapter_folder, prepared.model_path)  # vLLM would score a misfit adapter without a word
    started_ray = connect_ray(config, log)
    learner, pool = None, None
    try:
        with tempfile.TemporaryDirectory(prefix="qerl-eval-") as scratch:
            # no run folder to keep actor logs in: they stay with Ray's (shown with ray.log_to_driver)
            learner, info = start_learner(config, prepared.model_path, scratch, None,
                                          lora=config.lora.model_copy(update={"rank": rank}))
            pool = start_pool(config, info, rank, log)
            try:
                pool.update_adapter(update)
            except ray.exceptions.RayError as error:
                raise QerlError(f"adapter {adapter_folder} does not fit the model {prepared.model_path}: "
                                f"{str(error).strip().splitlines()[-1]}") from None
            log(f"[qerl] evaluating {adapter_folder} on {len(problems)} held-out problems")
            return evaluate(pool, prepared.prompts, prepared.task, problems, config,
                            seed=config.train.seed + EVAL_SEED_OFFSET)
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

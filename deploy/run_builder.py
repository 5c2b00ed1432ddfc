"""The one run builder: what training, `qerl eval` and the fidelity benchmark share to start a run.

`prepare_run` does every check that needs no actor (serving support, the task and its data,
the model folder, the prompt encoder, the reward function), so bad input is a one-line error
before any engine starts; `start_learner` and `start_pool` then start the actors the same way
for every caller (the learner's settings with the run's length resolved, random weights, actor
logs under log_dir).
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from learner.actor import LearnerActor, LearnerSpec
from learner.model import context_length_problem, resolve_model_path
from rollout_server.pool import RolloutPool, ready_or_error
from rollout_server.vllm_internals import serving_problem
from shared.config import LoraConfig, QerlConfig
from shared.errors import QerlError
from shared.formats import POLICY_FORMATS, fp8_activation_rounding
from shared.process_output import actor_log_env
from shared.prompts import PromptEncoder, load_prompt_encoder
from shared.scoring import Grade, training_grade
from shared.tasks import Task, build_task


@dataclass(frozen=True)
class Prepared:
    """A run's inputs, checked: nothing started yet."""

    task: Task
    model_path: str
    prompts: PromptEncoder
    grade: Grade
    """What training scores with: task.reward, else the task's own grade."""

    @property
    def tokenizer(self):
        return self.prompts.tokenizer


def prepare_run(config: QerlConfig, log=print) -> Prepared:
    problem = serving_problem(config.policy.format, config.rollout)
    if problem:
        raise QerlError(problem)
    caveat = POLICY_FORMATS[config.policy.format].caveat
    if caveat:
        log(f"[qerl] note: policy.format {config.policy.format} is {caveat}")
    task = build_task(config.task)
    grade = training_grade(task, config.task)
    model_path = resolve_model_path(config.model.path, log)
    problem = context_length_problem(model_path, config.rollout.max_model_len)
    if problem:
        raise QerlError(problem)
    return Prepared(task, model_path, load_prompt_encoder(model_path, config.task), grade)


def start_learner(config: QerlConfig, model_path: str, out_dir: str, log_dir: str | None,
                  lora: LoraConfig | None = None) -> tuple[ray.actor.ActorHandle, dict]:
    """The learner actor, ready; `out_dir` receives the base the engines serve."""
    spec = LearnerSpec(model_path, lora or config.lora, config.learner_settings(), out_dir, config.policy,
                       config.engine_dtype(), config.train.seed, "cuda" if config.learner.num_gpus > 0 else "cpu",
                       config.model.random_weights,
                       fp8_activation_rounding(config.rollout.device(), config.rollout.enforce_eager))
    learner = ray.remote(LearnerActor).options(
        num_cpus=config.learner.num_cpus, num_gpus=config.learner.num_gpus,
        runtime_env={"env_vars": actor_log_env(log_dir, "learner")},
    ).remote(spec)
    try:
        return learner, ready_or_error(learner, "the learner")
    except BaseException:
        ray.kill(learner)
        raise


def start_pool(config: QerlConfig, learner_info: dict, lora_rank: int, log=print,
               log_dir: str | None = None) -> RolloutPool:
    return RolloutPool(learner_info["served"], config.engine_rollout(), lora_rank, log=log, log_dir=log_dir)

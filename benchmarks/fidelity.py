"""`qerl bench fidelity`: how far each policy pair's rollout engine is from its learner.

For every format asked for (default: every one this machine's vLLM can serve), it builds the
learner of that pair, moves its LoRA off zero with two optimizer steps, pushes the adapter into
one rollout worker as training does, samples the task's prompts there, and scores the very same
tokens with the learner. Per sampled token, with d = log pi_learner - log pi_rollout:

- KL(rollout || learner), estimated as exp(d) - 1 - d (non-negative, unbiased for the KL when the
  tokens come from the rollout policy; the training loop's `mismatch/kl` is the same estimator);
- |d|, mean and max;
- the rollout policy's entropy, estimated as the mean of -log pi_rollout over its own samples
  (QeRL's claim: quantization noise raises it).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from random import Random

from benchmarks.common import check_policy_formats, environment_facts, logprob_gap, print_table, write_json
from benchmarks.workers import started_ray
from learner.actor import Learner, LearnerSpec, build_learner
from rollout_server.pool import RolloutPool
from rollout_server.vllm_internals import serving_problem
from shared.config import QerlConfig
from shared.errors import QerlError
from shared.formats import POLICY_FORMATS, fp8_activation_rounding
from shared.tasks import build_task
from shared.types import SamplingSettings, TrainSample


@dataclass(frozen=True)
class FidelityBenchArgs:
    formats: tuple[str, ...] = ()
    """Policy formats to compare; empty: every one the installed vLLM serves on this device."""
    prompts: int = 32
    json: str | None = None


def bench_fidelity(config: QerlConfig, args: FidelityBenchArgs, log=print) -> dict:
    from learner.model import resolve_model_path
    from shared.prompts import load_prompt_encoder

    formats = args.formats or tuple(POLICY_FORMATS)
    check_policy_formats(formats)
    model_path = resolve_model_path(config.model.path, log)
    problems = build_task(config.task).sample(Random(config.train.seed), args.prompts)
    prompt_ids = load_prompt_encoder(model_path, config.task).encode([p.prompt for p in problems])
    rows, skipped = [], {}
    with started_ray(config.rollout), tempfile.TemporaryDirectory(prefix="qerl-fidelity-") as scratch:
        for policy_format in formats:
            problem = serving_problem(policy_format, config.rollout)
            if problem and args.formats:
                raise QerlError(problem)
            if problem:
                skipped[policy_format] = problem
                log(f"[qerl]   skipped: {problem}")
                continue
            rows.append(_measure_pair(config, policy_format, model_path, prompt_ids, f"{scratch}/{policy_format}", log))
    print_table(["format", "exact", "engine dtype", "tokens", "KL mean", "KL max", "|d| mean", "|d| max",
                 "rollout entropy"],
                [[r["format"], r["exact"], r["engine_dtype"], r["tokens"], f"{r['kl_mean']:.2e}", f"{r['kl_max']:.2e}",
                  f"{r['abs_diff_mean']:.2e}", f"{r['abs_diff_max']:.2e}", f"{r['rollout_entropy']:.4f}"]
                 for r in rows], log)
    result = {"benchmark": "fidelity", "args": asdict(args), "config": config.model_dump(),
              "environment": environment_facts(), "rows": rows, "skipped": skipped}
    write_json(args.json, result, log)
    return result


def _measure_pair(config: QerlConfig, policy_format: str, model_path: str, prompt_ids: list[list[int]],
                  run_dir: str, log) -> dict:
    engine_dtype = config.rollout.engine_dtype(policy_format)
    policy = config.policy.model_copy(update={"format": policy_format})
    learner_device = "cuda" if config.learner.num_gpus > 0 else "cpu"
    spec = LearnerSpec(model_path, config.lora, config.learner.model_copy(update={"lr": 1e-2, "warmup_steps": 0}),
                       run_dir, policy, engine_dtype, config.train.seed, learner_device,
                       fp8_rounding=fp8_activation_rounding(config.rollout.device(), config.rollout.enforce_eager))
    learner = build_learner(spec, log)
    rollout = config.rollout.model_copy(update={"num_workers": 1, "dtype": engine_dtype, "dispatch": "slices"})
    pool = RolloutPool(learner.rollout_base(), rollout, config.lora.rank, log=log)
    n, temperature = rollout.samples_per_prompt, rollout.temperature
    try:
        sampling = SamplingSettings(n, temperature, rollout.max_new_tokens, seed=config.train.seed)
        _move_lora(learner, pool, prompt_ids, sampling)
        completions = pool.generate(prompt_ids, sampling)
    finally:
        pool.shutdown()
    learner_logprobs = learner.logprobs([(prompt_ids[c.prompt_index], c.token_ids) for c in completions], temperature)
    diffs = [lp - rp for c, row in zip(completions, learner_logprobs) for lp, rp in zip(row, c.logprobs)]
    rollout_entropy = -sum(lp for c in completions for lp in c.logprobs) / len(diffs)
    row = {"format": policy_format, "exact": POLICY_FORMATS[policy_format].exact, "engine_dtype": engine_dtype,
           **logprob_gap(diffs), "rollout_entropy": rollout_entropy}
    log(f"[qerl]   {policy_format}: KL mean {row['kl_mean']:.2e}, max |d| {row['abs_diff_max']:.2e}, "
        f"rollout entropy {rollout_entropy:.4f}")
    return row


def _move_lora(learner: Learner, pool: RolloutPool, prompt_ids: list[list[int]], sampling: SamplingSettings) -> None:
    """Two optimizer steps on the engine's own samples (alternating advantages), then the
    adapter into the worker, so the comparison covers base and LoRA."""
    for _ in range(2):
        completions = pool.generate(prompt_ids, sampling)
        samples = [TrainSample(prompt_ids[c.prompt_index], c.token_ids, c.logprobs, 1.0 if i % 2 else -1.0)
                   for i, c in enumerate(completions)]
        learner.train_step(samples, sampling.temperature)
    pool.update_adapter(learner.export_adapter())  # the pool puts it in the object store once

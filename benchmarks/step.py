"""`qerl bench step`: the whole RL step, per policy format, placed as `qerl train` places it.

Each format gets a real run built by `deploy.train.start_run` (the learner actor, the rollout
fleet, Ray), then `--steps` steps of: generate the step's batch on the fleet (every sequence to
its drawn length: `--lengths fixed` runs all to --gen-len, `lognormal` draws long-tailed lengths
with a mean of a third of it, as reasoning traces are), train on it (random +-1 advantages: the
values do not change the cost), push the new adapter. The first step warms up (compilation,
the first LoRA load) and is not counted; the medians of the rest are reported.

Learner MFU is its GEMM FLOPs over its time and the bf16 GEMM rate this GPU reaches on a 7B
layer (measured in a subprocess first): linear layers 2 (forward) + 2 (input gradient) + 2
(recompute, with gradient checkpointing) FLOPs per weight and real token, the vocabulary
projection the same per completion token. Padding therefore shows as lost MFU.

`--gpu-memory-gib B` lets the GPU stand in for a smaller card: the engines' share
(rollout.gpu_memory_utilization) is scaled by B / the GPU's memory and the learner is capped at
the rest of B (learner.gpu_memory_gib).
"""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.common import environment_facts, gemm_floor_tflops, learner_gemm_flops, print_table, write_json
from shared.config import QerlConfig
from shared.errors import QerlError
from shared.formats import POLICY_FORMATS

LENGTH_MIXES = ("fixed", "lognormal")
LOGNORMAL_SIGMA = 1.0
"""Spread of log lengths: about one completion in six runs into the limit at a mean of a third."""


@dataclass(frozen=True)
class StepBenchArgs:
    shape: str | None = None
    formats: tuple[str, ...] = ()
    steps: int = 3
    prompt_len: int = 10
    gen_len: int = 256
    lengths: str = "fixed"
    gpu_memory_gib: float | None = None
    profile: str | None = None
    """Folder: after the timed steps, one more step's learner phase under torch.profiler, in the
    learner's process (not timed); op table in profile/FORMAT/ops.txt."""
    json: str | None = None


def draw_lengths(count: int, limit: int, mix: str, seed: int) -> list[int]:
    """Completion lengths: all `limit`, or lognormal with mean limit / 3, clipped to [1, limit]."""
    if mix == "fixed":
        return [limit] * count
    rng = random.Random(seed)
    mu = math.log(limit / 3) - LOGNORMAL_SIGMA**2 / 2
    return [min(limit, max(1, round(rng.lognormvariate(mu, LOGNORMAL_SIGMA)))) for _ in range(count)]


def step_config(config: QerlConfig, args: StepBenchArgs, policy_format: str, run_dir: Path) -> QerlConfig:
    """The run config of one format: its model folder, a scratch run folder, no evaluation or
    periodic checkpoint, the memory budget applied."""
    from benchmarks.shapes import random_packed_shape_folder, write_shape_model
    from learner.policy import PACKED_SCHEMES

    model: dict = {}
    if args.shape is not None:
        engine = POLICY_FORMATS[policy_format].engine
        if engine in PACKED_SCHEMES:  # random quantized weights, written once into the qerl cache
            folder = random_packed_shape_folder(args.shape, engine, config.policy.group_size)
            model = {"path": str(folder), "random_weights": False}
        else:
            model = {"path": str(write_shape_model(args.shape, run_dir.parent / f"{args.shape}-shape")),
                     "random_weights": True}
    rollout: dict = {"max_model_len": args.prompt_len + args.gen_len + 16}
    learner: dict = {}
    if args.gpu_memory_gib:
        total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        engines = config.rollout.gpu_memory_utilization * args.gpu_memory_gib / total_gib
        rollout["gpu_memory_utilization"] = engines
        learner["gpu_memory_gib"] = args.gpu_memory_gib * (1 - config.rollout.gpu_memory_utilization
                                                            * config.rollout.num_workers)
    train = {"run_dir": str(run_dir), "overwrite": True, "eval_every": 0, "steps": args.steps + 1}
    return config.model_copy(update={
        "model": config.model.model_copy(update=model),
        "policy": config.policy.model_copy(update={"format": policy_format}),
        "rollout": config.rollout.model_copy(update=rollout),
        "learner": config.learner.model_copy(update=learner),
        "train": config.train.model_copy(update=train),
        "checkpoint": config.checkpoint.model_copy(update={"every": 0, "minutes": 0}),
    })


def gpu_used_gib() -> float | None:
    """Memory in use on GPU 0 by every process (nvidia-smi), None without one."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=30)
        return float(done.stdout.split()[0]) / 1024
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def bench_step(config: QerlConfig, args: StepBenchArgs, log=print) -> dict:
    if args.lengths not in LENGTH_MIXES:
        raise QerlError(f"--lengths takes {' or '.join(LENGTH_MIXES)}, not {args.lengths}")
    formats = args.formats or (config.policy.format,)
    unknown = [f for f in formats if f not in POLICY_FORMATS]
    if unknown:
        raise QerlError(f"--formats: unknown policy format {unknown[0]} (known: {', '.join(POLICY_FORMATS)})")
    if args.gpu_memory_gib and not torch.cuda.is_available():
        raise QerlError("--gpu-memory-gib needs a GPU")
    floor = gemm_floor_tflops()
    log(f"[qerl] bench step: {args.shape or 'config model'}, formats {','.join(formats)}, "
        f"{config.train.prompts_per_step} prompts x {config.rollout.samples_per_prompt}, prompt {args.prompt_len}, "
        f"gen {args.gen_len} ({args.lengths}), {args.steps} timed steps"
        + (f", GEMM floor {floor:.0f} TFLOP/s" if floor else ""))
    rows: list[dict] = []
    result = {"benchmark": "step", "args": asdict(args), "config": config.model_dump(), "gemm_floor_tflops": floor,
              "environment": environment_facts(), "rows": rows}
    with tempfile.TemporaryDirectory(prefix="qerl-bench-step-") as scratch:
        for policy_format in formats:
            run_config = step_config(config, args, policy_format, Path(scratch) / policy_format)
            rows.append(_format_row(run_config, args, policy_format, floor, log))
            rows[-1]["step_vs_first"] = rows[-1]["step_s"] / rows[0]["step_s"]
            rows[-1]["learner_vs_first"] = rows[-1]["learner_s"] / rows[0]["learner_s"]
            if policy_format != formats[-1]:  # what is done survives a run cut short
                write_json(args.json, result, lambda *_: None)
    print_table(["format", "step s", f"vs {rows[0]['format']}", "rollout s", "learner s", f"vs {rows[0]['format']}",
                 "sync s", "learner tok/s", "MFU", "padding (unsorted)", "learner GiB", "GPU used GiB"],
                [[r["format"], r["step_s"], r["step_vs_first"], r["rollout_s"], r["learner_s"], r["learner_vs_first"],
                  r["sync_s"], r["learner_tok_per_s"],
                  "-" if r["learner_mfu"] is None else f"{r['learner_mfu']:.1%}",
                  f"{r['padding_frac']:.1%} ({r['padding_frac_unsorted']:.1%})", r["learner_peak_gib"],
                  r["gpu_used_gib"]] for r in rows], log)
    write_json(args.json, result, log)
    return result


def _format_row(config: QerlConfig, args: StepBenchArgs, policy_format: str, floor: float | None, log) -> dict:
    from deploy.train import start_run

    run = start_run(config, log=lambda line: log(f"[qerl]   {policy_format}: {line.removeprefix('[qerl] ')}"))
    try:
        steps = []
        for step in range(args.steps + 1):  # step 0 warms up; each logged, so a cut-off run still tells
            steps.append(_one_step(run, step, args))
            log(f"[qerl]   {policy_format}: step {step}{' (warm-up)' if step == 0 else ''}: "
                f"{steps[-1]['step_s']:.2f} s (rollout {steps[-1]['rollout_s']:.2f}, "
                f"learner {steps[-1]['learner_s']:.2f}, sync {steps[-1]['sync_s']:.2f})")
        steps = steps[1:]
        profile = _profile_learner(run, args.steps + 1, args, policy_format, log) if args.profile else None
    finally:
        run.close()
    median = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    row = {"format": policy_format, **{key: median(key) for key in steps[0]}}
    if math.isnan(row["learner_peak_gib"]):  # no GPU: JSON null, not NaN
        row["learner_peak_gib"] = None
    recompute = bool(steps[-1]["gradient_checkpointing"])
    flops = learner_gemm_flops(_model_folder(config), row["sequence_tokens"], row["completion_tokens"], recompute)
    row["learner_tok_per_s"] = row["sequence_tokens"] / row["learner_s"]
    row["learner_tflops"] = flops / row["learner_s"] / 1e12
    row["learner_mfu"] = row["learner_tflops"] / floor if floor else None
    row["engine_reserved_gib"] = (config.rollout.gpu_memory_utilization * torch.cuda.get_device_properties(0)
                                  .total_memory / 2**30 * config.rollout.num_workers
                                  if torch.cuda.is_available() else None)
    row["learner_profile"] = profile
    log(f"[qerl]   {policy_format}: step {row['step_s']:.2f} s (rollout {row['rollout_s']:.2f}, learner "
        f"{row['learner_s']:.2f}, sync {row['sync_s']:.2f}), padding {row['padding_frac']:.1%}")
    return row


def _profile_learner(run, step: int, args: StepBenchArgs, policy_format: str, log) -> dict:
    """One more step's batch, its learner phase run under torch.profiler inside the learner actor
    (Ray's __ray_call__ runs a function there: the learner module knows nothing of benchmarks)."""
    import ray

    samples, _, _ = _rollout_batch(run, step, args)
    out_dir = str(Path(args.profile).resolve() / policy_format)
    summary = ray.get(run.learner.__ray_call__.remote(_profiled_train_step, samples,
                                                      run.config.rollout.temperature, out_dir))
    log(summary["line"].replace("[qerl] profile:", f"[qerl]   {policy_format}: learner profile:", 1))
    return summary


def _profiled_train_step(learner, samples: list, temperature: float, out_dir: str) -> dict:
    """Runs in the learner actor's process."""
    from benchmarks.profile import profile_generate

    return profile_generate(lambda: learner.train_step(samples, temperature), 1, out_dir, unit="learner step")


def _one_step(run, step: int, args: StepBenchArgs) -> dict[str, float]:
    """Generate, train, push: the parts of `qerl train`'s step that cost time."""
    from deploy.train import learn, sync

    started = time.perf_counter()
    samples, rollout_s, generated_tokens = _rollout_batch(run, step, args)
    generated = time.perf_counter()
    stats = learn(run, step, samples)
    learned = time.perf_counter()
    sync(run, int(stats["learner/version"]))
    synced = time.perf_counter()
    return {"step_s": synced - started, "rollout_s": rollout_s, "learner_s": learned - generated,
            "sync_s": synced - learned, "rollout_tok_per_s": generated_tokens / rollout_s,
            "sequence_tokens": stats["learner/sequence_tokens"],
            "completion_tokens": stats["learner/tokens"], "padding_frac": stats["learner/padding_frac"],
            "padding_frac_unsorted": stats["learner/padding_frac_unsorted"],
            "micro_batch_tokens": stats["learner/micro_batch_tokens"],
            "gradient_checkpointing": stats["learner/gradient_checkpointing"],
            "compiled_layers": stats["learner/compiled_layers"],
            "learner_peak_gib": stats.get("learner/peak_gib", float("nan")), "gpu_used_gib": gpu_used_gib() or 0.0}


def _rollout_batch(run, step: int, args: StepBenchArgs) -> tuple[list, float, int]:
    """Step `step`'s batch generated on the fleet (its drawn lengths, random +-1 advantages):
    the samples, the seconds it took and the tokens generated."""
    from deploy.rollouts import step_noise
    from shared.types import SamplingSettings, TrainSample

    config = run.config
    n, prompts_per_step = config.rollout.samples_per_prompt, config.train.prompts_per_step
    rng = random.Random(config.train.seed * 7919 + step)
    vocab = _vocab(_model_folder(config))
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(prompts_per_step)]
    requests = [prompt for prompt in prompts for _ in range(n)]  # one request per sample: one length each
    limits = tuple(draw_lengths(len(requests), args.gen_len, args.lengths, seed=step))
    sampling = SamplingSettings(1, config.rollout.temperature, args.gen_len, seed=step, ignore_eos=True,
                                max_new_tokens_by_prompt=limits)
    started = time.perf_counter()
    completions = run.pool.collect(run.pool.submit(requests, sampling, step_noise(config, step)))
    seconds = time.perf_counter() - started
    samples = [TrainSample(requests[c.prompt_index], c.token_ids, c.logprobs, rng.choice((-1.0, 1.0)))
               for c in completions]
    return samples, seconds, sum(len(c.token_ids) for c in completions)


def _model_folder(config: QerlConfig) -> Path:
    """model.path, or the embedded tiny model's folder (as the run resolved it)."""
    from learner.model import resolve_model_path

    return Path(resolve_model_path(config.model.path, log=lambda *_: None))


def _vocab(model_folder: Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_folder).vocab_size

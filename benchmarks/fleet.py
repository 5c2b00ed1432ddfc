"""`qerl bench fleet`: rollout tok/s of a whole fleet of 1, 2, 4... workers on the same prompts,
each timed step being what a training step asks of the fleet: push a new adapter to every
worker (from the object store, as `qerl train` does), then generate the step's batch
(train.prompts_per_step x rollout.samples_per_prompt, every sequence to --gen-len tokens)
through the work queue. The fleet's tok/s is the step's tokens over the whole step, push
included. Ratios are to the first fleet size. `--dispatch queue,slices` compares
the two ways of handing out prompts; `--slow-worker F` makes worker 0 F times slower (it sleeps
F - 1 times as long as it generated), to see whether the queue keeps the fleet's pace.

Workers take rollout.num_gpus_per_worker each: one GPU per worker on a multi-GPU machine, or a
fraction of one GPU (e.g. 0.4, with rollout.gpu_memory_utilization below it) to share one.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import ray

from benchmarks.common import environment_facts, model_label, print_table, resolve_bench_model, write_json
from benchmarks.random_adapter import random_adapter
from benchmarks.rollout import bench_served_base, random_prompts, sequence_lengths
from benchmarks.workers import BenchWorker, bench_rollout_config, started_ray
from rollout_server.pool import RolloutPool
from shared.config import QerlConfig
from shared.errors import QerlError
from shared.formats import dtype_of
from shared.types import SamplingSettings


@dataclass(frozen=True)
class FleetBenchArgs:
    shape: str | None = None
    workers: tuple[int, ...] = (1, 2, 4)
    dispatch: tuple[str, ...] = ("queue",)
    slow_worker: float = 1.0
    """Worker 0 takes this many times as long per chunk (1: no slowdown)."""
    steps: int = 3
    """Timed steps per fleet (after one untimed); the median is reported."""
    prompt_len: int | None = None
    gen_len: int | None = None
    json: str | None = None


def bench_fleet(config: QerlConfig, args: FleetBenchArgs, log=print) -> dict:
    from transformers import AutoConfig

    if any(d not in ("queue", "slices") for d in args.dispatch):
        raise QerlError(f"--dispatch takes queue and/or slices, not {','.join(args.dispatch)}")
    if args.slow_worker < 1:
        raise QerlError(f"--slow-worker is a slowdown factor >= 1, not {args.slow_worker:g}")
    folder, is_random = resolve_bench_model(args.shape, config)
    context = AutoConfig.from_pretrained(folder).max_position_embeddings
    prompt_len, gen_len = sequence_lengths(args.prompt_len, args.gen_len, context)
    rollout = bench_rollout_config(config.rollout, is_random, prompt_len + gen_len + 16)
    n, prompts_per_step = rollout.samples_per_prompt, config.train.prompts_per_step
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    prompts = random_prompts(prompts_per_step, prompt_len, vocab, seed=config.train.seed)
    update = random_adapter(folder, config.lora.rank, dtype=dtype_of(config.engine_dtype()))
    log(f"[qerl] bench fleet: {model_label(args.shape, folder)}, {config.policy.format}, LoRA r{config.lora.rank}, "
        f"{prompts_per_step} prompts x {n} samples, prompt {prompt_len}, gen {gen_len}, workers "
        f"{','.join(map(str, args.workers))}, {rollout.num_cpus_per_worker:g} CPU and {rollout.num_gpus_per_worker:g} "
        f"GPU each, dispatch {','.join(args.dispatch)}, chunks of {rollout.chunk_sequences} sequences"
        + (f", worker 0 slowed {args.slow_worker:g}x" if args.slow_worker > 1 else ""))
    rows = []
    biggest = rollout.model_copy(update={"num_workers": max(args.workers)})
    with started_ray(biggest):
        served = bench_served_base(folder, args.shape, config.policy.format, config)
        for dispatch in args.dispatch:
            for workers in args.workers:
                fleet = rollout.model_copy(update={"num_workers": workers, "dispatch": dispatch})
                pool = RolloutPool(served, fleet, config.lora.rank, log=lambda *_: None, worker_class=BenchWorker)
                try:
                    if args.slow_worker > 1:
                        ray.get(pool.live_workers()[0].set_slowdown.remote(args.slow_worker))
                    row = _timed_steps(pool, prompts, update, n, gen_len, args.steps)
                finally:
                    pool.shutdown()
                rows.append({"dispatch": dispatch, "workers": workers, **row})
                log(f"[qerl]   {dispatch}, {workers} worker(s): {row['tok_per_s']:,.0f} tok/s, step "
                    f"{row['step_s']:.2f} s, push {row['push_ms']:.1f} ms, chunks per worker {row['chunks_by_worker']}")
    for row in rows:
        first = next(r for r in rows if r["dispatch"] == row["dispatch"])
        row["ratio_to_first"] = row["tok_per_s"] / first["tok_per_s"]
    print_table(["dispatch", "workers", "fleet tok/s", f"vs {rows[0]['workers']}", "step s", "push ms",
                 "chunks per worker"],
                [[r["dispatch"], r["workers"], r["tok_per_s"], r["ratio_to_first"], r["step_s"], r["push_ms"],
                  " ".join(map(str, r["chunks_by_worker"]))] for r in rows], log)
    result = {"benchmark": "fleet", "args": asdict(args), "config": config.model_dump(), "prompt_len": prompt_len,
              "gen_len": gen_len, "environment": environment_facts(), "rows": rows}
    write_json(args.json, result, log)
    return result


def _timed_steps(pool: RolloutPool, prompts: list[list[int]], update, n: int, gen_len: int, steps: int) -> dict:
    """One untimed step, then `steps` timed ones: an adapter push to every worker, then the batch."""
    step_s, push_ms, tokens, chunks = [], [], [], None
    for step in range(steps + 1):
        started = time.perf_counter()
        pool.update_adapter(ray.put(replace(update, version=step + 1)))
        pushed = time.perf_counter()
        sampling = SamplingSettings(n, 1.0, gen_len, seed=step, ignore_eos=True)
        completions = pool.generate(prompts, sampling)
        finished = time.perf_counter()
        if {c.adapter_version for c in completions} != {step + 1}:
            raise QerlError(f"internal: step {step} was served by adapter versions "
                            f"{sorted({c.adapter_version for c in completions})}, not {step + 1}")
        chunks_now = {slot: stats.chunks for slot, stats in pool.stats.items()}
        pool.worker_metrics(finished - pushed)  # restart the per-worker counts
        if step == 0:
            continue
        step_s.append(finished - started)
        push_ms.append((pushed - started) * 1e3)
        tokens.append(sum(len(c.token_ids) for c in completions))
        chunks = chunks_now
    generation = [s - p / 1e3 for s, p in zip(step_s, push_ms)]
    return {"tok_per_s": statistics.median(t / s for t, s in zip(tokens, step_s)),
            "generate_tok_per_s": statistics.median(t / g for t, g in zip(tokens, generation)),
            "step_s": statistics.median(step_s), "push_ms": statistics.median(push_ms),
            "tokens_per_step": tokens[0], "chunks_by_worker": [chunks[slot] for slot in sorted(chunks)]}

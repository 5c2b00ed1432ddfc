"""`qerl bench sync`: adapter push latency from the driver into `rollout.num_workers` workers, in
memory (object store -> worker extension, as training does) vs a peft folder on disk (vLLM's
add_lora), p50/p95, and where the slowest worker's in-memory load spends its time."""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import ray

from benchmarks.common import environment_facts, model_label, percentile, print_table, resolve_bench_model, write_json
from benchmarks.random_adapter import random_adapter, write_peft_folder
from benchmarks.rollout import bench_served_base
from benchmarks.workers import BenchWorker, bench_rollout_config, started_ray
from rollout_server.pool import RolloutPool
from shared.config import QerlConfig
from shared.formats import dtype_of


@dataclass(frozen=True)
class SyncBenchArgs:
    shape: str | None = None
    repeats: int = 20
    json: str | None = None


def bench_sync(config: QerlConfig, args: SyncBenchArgs, log=print) -> dict:
    folder, is_random = resolve_bench_model(args.shape, config)
    rollout = bench_rollout_config(config.rollout, is_random, config.rollout.max_model_len)
    update = random_adapter(folder, config.lora.rank, dtype=dtype_of(config.engine_dtype()))
    size_mb = update.payload.nbytes / 2**20
    core = "in process" if rollout.in_process else "separate"
    log(f"[qerl] bench sync: {model_label(args.shape, folder)}, LoRA r{config.lora.rank} ({size_mb:,.1f} MB in the "
        f"engine's dtype), {rollout.num_workers} workers, engine core {core}")
    memory, disk = [], []  # (end-to-end ms, slowest worker's own ms) per repeat
    phases: list[dict[str, float]] = []  # the slowest worker's in-memory load, phase by phase
    with started_ray(rollout), tempfile.TemporaryDirectory(prefix="qerl-sync-") as scratch:
        served = bench_served_base(folder, args.shape, config.policy.format, config)
        pool = RolloutPool(served, rollout, config.lora.rank, log=log, worker_class=BenchWorker)
        try:
            ray.get([worker.time_load_phases.remote(True) for worker in pool.live_workers()])
            for index in range(args.repeats + 1):  # the first of each is a warm-up
                version = 2 * index + 1
                started = time.perf_counter()
                worker_ms = pool.update_adapter(ray.put(replace(update, version=version)))
                memory.append(((time.perf_counter() - started) * 1e3, max(worker_ms)))
                slowest = pool.live_workers()[worker_ms.index(max(worker_ms))]
                phases.append(ray.get(slowest.last_load_phases.remote()))
                started = time.perf_counter()
                path = write_peft_folder(update, Path(scratch) / f"v{version + 1}")
                workers = pool.live_workers()
                worker_ms = ray.get([w.load_adapter_from_disk.remote(str(path), version + 1) for w in workers])
                disk.append(((time.perf_counter() - started) * 1e3, max(worker_ms)))
            served = ray.get([worker.loaded_adapters.remote() for worker in pool.live_workers()])
        finally:
            pool.shutdown()
    rows = [
        {"route": route, "p50_ms": percentile([t for t, _ in times[1:]], 50),
         "p95_ms": percentile([t for t, _ in times[1:]], 95),
         "worker_p50_ms": percentile([w for _, w in times[1:]], 50)}
        for route, times in (("in-memory (object store)", memory), ("disk (peft folder, add_lora)", disk))
    ]
    log("[qerl] end to end: from the driver holding the adapter until every worker has it; worker: the "
        "slowest worker's own load time")
    print_table(["route", "p50 ms", "p95 ms", "worker p50 ms"],
                [[r["route"], r["p50_ms"], r["p95_ms"], r["worker_p50_ms"]] for r in rows], log)
    phase_p50 = {name: percentile([p[name] for p in phases[1:]], 50) for name in phases[0]}
    log("[qerl] in-memory load in the slowest worker, p50 ms: "
        + ", ".join(f"{name} {ms:.1f}" for name, ms in phase_p50.items())
        + " (copy: payload to the engine's device; build: vLLM LoRAModel; activate: into the serving slots)")
    result = {"benchmark": "sync", "args": asdict(args), "config": config.model_dump(),
              "environment": environment_facts(), "adapter_mb": size_mb, "rows": rows,
              "in_memory_phase_p50_ms": phase_p50, "served_adapters": served, "last_version": 2 * args.repeats + 2}
    write_json(args.json, result, log)
    return result

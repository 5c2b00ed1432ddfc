"""`qerl bench rollout` and `qerl bench sync`.

rollout: generated tokens/s of one vLLM rollout engine (with a LoRA adapter loaded from
memory) across a concurrency sweep, and, in the same run on the same prompts, of the peer a
user would otherwise use: Hugging Face `generate` on the same base with the same peft adapter.
Every request runs to max_tokens (ignore_eos), so random weights measure real speed.

sync: adapter push latency from the driver into N workers, in memory (object store ->
worker extension) vs a peft folder on disk (vLLM's add_lora), p50/p95.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rollout_server.rollout_profile import profile_generate
from rollout_server.worker import RolloutWorker
from shared.adapter_payload import decode_adapter
from shared.bench_utils import (
    copy_bandwidth, environment_facts, percentile, print_table, resolve_bench_model, sync_device, weight_bytes,
    write_json,
)
from shared.config import RolloutConfig
from shared.errors import QerlError
from shared.random_adapter import random_adapter, write_peft_folder
from shared.types import SamplingSettings


@dataclass(frozen=True)
class RolloutBenchArgs:
    model: str = "tiny"
    lora_rank: int = 32
    base_format: str = "auto"
    concurrency: tuple[int, ...] = (16, 64, 256)
    prompt_len: int = 256
    gen_len: int = 512
    samples_per_prompt: int = 8
    peer_concurrency: tuple[int, ...] = (16, 64)
    peer_gen_len: int | None = None
    """Tokens the HF peer generates; None: the same as gen_len (a fair comparison)."""
    peer_format: str = "nf4"
    repeats: int = 3
    """Timed vLLM runs per concurrency, after two short untimed ones; the table gives the median
    with every run listed (one run can catch a stall). The slow HF peer runs once."""
    gpu_memory_utilization: float = 0.6
    engine_core: str = "in-process"
    """'in-process' (qerl's default) or 'separate' (vLLM's own engine-core process)."""
    request_seeds: bool = True
    """rollout.request_seeds: a sampling seed per request."""
    lora_kernel_configs: str | None = None
    """rollout.lora_kernel_configs: tuned LoRA kernel configs (`qerl bench lora-kernels`)."""
    kv_cache_dtype: str = "auto"
    """rollout.kv_cache_dtype."""
    profile: str | None = None
    """Folder: after the sweep, profile one generate of `profile_seqs` sequences (up to 128
    generated tokens, to keep the trace small) and write its op table there."""
    profile_seqs: int = 64
    json: str | None = None


WARMUP_TOKENS = 32
"""Tokens each untimed warm-up generate runs, per concurrency, before the timed runs."""


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rollout_config(folder_is_random: bool, base_format: str, args_gpu_util: float, max_len: int,
                    engine_core: str, workers: int = 1, eager: bool | None = None,
                    gpu_kv_cache_bytes: int | None = None, request_seeds: bool = True,
                    lora_kernel_configs: str | None = None, kv_cache_dtype: str = "auto") -> RolloutConfig:
    """gpu_kv_cache_bytes: None lets vLLM size the KV cache on a GPU by profiling."""
    gpu = _device() == "cuda"
    quantization = base_format if base_format in ("fp8", "bitsandbytes") else None
    return RolloutConfig(
        num_workers=workers,
        num_gpus_per_worker=1 / workers if gpu else 0,
        num_cpus_per_worker=1.0 if gpu else 0.5,
        dtype="bfloat16" if gpu else "float32",
        max_model_len=max_len,
        kv_cache_memory_bytes=gpu_kv_cache_bytes if gpu else 512 * 2**20,
        gpu_memory_utilization=args_gpu_util / workers,
        enforce_eager=(not gpu) if eager is None else eager,
        quantization=quantization,
        load_format="dummy" if folder_is_random else "auto",
        in_process=engine_core == "in-process",
        request_seeds=request_seeds,
        lora_kernel_configs=lora_kernel_configs,
        kv_cache_dtype=kv_cache_dtype,
    )


def _random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def bench_rollout(args: RolloutBenchArgs, log=print) -> dict:
    from transformers import AutoConfig

    if args.profile and args.engine_core != "in-process":
        raise QerlError("--profile needs --engine-core in-process: the profiler sees only this process's engine")
    folder, is_random = resolve_bench_model(args.model)
    device = _device()
    base_format = args.base_format if args.base_format != "auto" else ("bf16" if device == "cuda" else "fp32")
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    n = args.samples_per_prompt
    log(f"[qerl] bench rollout: {args.model} ({'random weights' if is_random else folder}), base {base_format}, "
        f"LoRA r{args.lora_rank}, prompt {args.prompt_len}, gen {args.gen_len}, n={n}, device {device}, "
        f"engine core {args.engine_core}, request seeds {'on' if args.request_seeds else 'off'}, "
        f"LoRA kernels {args.lora_kernel_configs or 'vLLM defaults'}, KV cache {args.kv_cache_dtype}")
    adapter = random_adapter(folder, args.lora_rank) if args.lora_rank else None

    config = _rollout_config(is_random, base_format, args.gpu_memory_utilization, args.prompt_len + args.gen_len + 16,
                             args.engine_core, request_seeds=args.request_seeds,
                             lora_kernel_configs=args.lora_kernel_configs, kv_cache_dtype=args.kv_cache_dtype)
    worker = RolloutWorker(0, str(folder), config, max(args.lora_rank, 8))
    if adapter is not None:
        worker.load_adapter(adapter)
    bandwidth = copy_bandwidth(device)
    served_bytes = weight_bytes(folder, base_format)
    step_floor_s = served_bytes / bandwidth
    rows = []
    for seqs in args.concurrency:
        prompts = _random_prompts(max(1, seqs // n), args.prompt_len, vocab, seqs)
        # Short untimed passes at this batch's shapes first: with tuned LoRA kernel configs the
        # first two timed runs at 64 sequences ran at 47% and 82% of the later ones on the H200
        # (kernels built for new launch configs, it seems), and a median of 3 cannot hide two.
        # Twice: the second pass finds the prompts in the prefix cache, as every timed run does.
        for _ in range(2):
            worker.generate(prompts, SamplingSettings(n, 1.0, WARMUP_TOKENS, seed=seqs, ignore_eos=True))
        runs = []
        for repeat in range(args.repeats):
            sampling = SamplingSettings(n, 1.0, args.gen_len, seed=seqs + repeat, ignore_eos=True)
            started = time.perf_counter()
            completions = worker.generate(prompts, sampling)
            runs.append(sum(len(c.token_ids) for c in completions) / (time.perf_counter() - started))
        rows.append({"engine": f"vllm {base_format}", "seqs": len(completions), "tok_per_s": statistics.median(runs),
                     "tok_per_s_runs": runs, "floor_tok_per_s": len(completions) / step_floor_s})
        log(f"[qerl]   vLLM {len(completions)} seqs: {statistics.median(runs):,.0f} tok/s "
            f"(runs: {', '.join(f'{r:,.0f}' for r in runs)})")
    profile = None
    if args.profile:
        prompts = _random_prompts(max(1, args.profile_seqs // n), args.prompt_len, vocab, args.profile_seqs)
        steps = min(args.gen_len, 128)
        sampling = SamplingSettings(n, 1.0, steps, seed=args.profile_seqs, ignore_eos=True)
        profile = profile_generate(lambda: worker.generate(prompts, sampling), steps, args.profile, log)
    worker.shutdown()
    del worker

    peers = hf_generate_throughput(folder, is_random, args, adapter, vocab, log) if args.peer_concurrency else {}
    for row in rows:
        peer = peers.get(row["seqs"])
        row["peer_tok_per_s"] = peer
        row["ratio_to_peer"] = row["tok_per_s"] / peer if peer else None
    print_table(
        ["engine", "seqs", "tok/s", "HF peer tok/s", "ratio", "floor tok/s"],
        [[r["engine"], r["seqs"], r["tok_per_s"], r["peer_tok_per_s"], r["ratio_to_peer"], r["floor_tok_per_s"]]
         for r in rows],
        log,
    )
    log(f"[qerl] floor: {served_bytes / 2**30:.2f} GiB of weights / "
        f"{bandwidth / 1e9:,.0f} GB/s measured copy bandwidth = {step_floor_s * 1e3:.2f} ms per decode step")
    result = {"benchmark": "rollout", "args": args.__dict__, "environment": environment_facts(),
              "bandwidth_bytes_per_s": bandwidth, "decode_step_floor_ms": step_floor_s * 1e3, "rows": rows,
              "peer": {"format": args.peer_format, "gen_len": args.peer_gen_len or args.gen_len,
                       "tok_per_s": {str(k): v for k, v in peers.items()}}, "profile": profile}
    write_json(args.json, result, log)
    return result


def hf_generate_throughput(folder: Path, is_random: bool, args: RolloutBenchArgs, adapter, vocab: int,
                           log=print) -> dict[int, float]:
    """Hugging Face generate with the same base (in args.peer_format) and the same peft adapter."""
    from peft import set_peft_model_state_dict
    from learner.model import add_lora, benchmark_base

    device = _device()
    compute = torch.bfloat16 if device == "cuda" else torch.float32
    base = benchmark_base(folder, is_random, args.peer_format, device, compute)
    model = base
    if adapter is not None:
        model = add_lora(base, args.lora_rank, adapter.peft_config["lora_alpha"], adapter.peft_config["target_modules"])
        tensors = decode_adapter(adapter.payload)
        set_peft_model_state_dict(model, {k.replace("base_model.model.", "", 1): v for k, v in tensors.items()})
    model.train(False)
    results = {}
    n = args.samples_per_prompt
    for seqs in args.peer_concurrency:
        prompts = torch.tensor(_random_prompts(max(1, seqs // n), args.prompt_len, vocab, seqs), device=device)
        length = args.peer_gen_len or args.gen_len
        # remove_invalid_values: a NaN logit would end the process in a device-side assert
        # and lose the vLLM figures already measured; it costs two elementwise ops per step
        kwargs = dict(do_sample=True, temperature=1.0, max_new_tokens=length, min_new_tokens=length,
                      num_return_sequences=n, pad_token_id=0, remove_invalid_values=True)
        with torch.no_grad():
            model.generate(prompts[:1], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
            sync_device(device)
            started = time.perf_counter()
            output = model.generate(prompts, **kwargs)
            sync_device(device)
        elapsed = time.perf_counter() - started
        generated = (output.shape[1] - prompts.shape[1]) * output.shape[0]
        results[output.shape[0]] = generated / elapsed
        log(f"[qerl]   HF generate ({args.peer_format} + peft) {output.shape[0]} seqs: {generated / elapsed:,.1f} tok/s")
    del model, base
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


@dataclass(frozen=True)
class SyncBenchArgs:
    model: str = "tiny"
    lora_rank: int = 16
    workers: int = 2
    repeats: int = 20
    gpu_memory_utilization: float = 0.8
    engine_core: str = "in-process"
    json: str | None = None


def bench_sync(args: SyncBenchArgs, log=print) -> dict:
    import ray

    from rollout_server.pool import RolloutPool

    folder, is_random = resolve_bench_model(args.model)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=max(2, args.workers + 1), include_dashboard=False)
    gpu = _device() == "cuda"
    # A fixed KV size: engines that profile one GPU at the same time trip vLLM's memory check.
    config = _rollout_config(is_random, "bf16" if gpu else "fp32", args.gpu_memory_utilization, max_len=256,
                             engine_core=args.engine_core, workers=args.workers, eager=True,
                             gpu_kv_cache_bytes=2**30)
    pool = RolloutPool(str(folder), config, args.lora_rank, log=log)
    update = random_adapter(folder, args.lora_rank, dtype=torch.bfloat16 if gpu else torch.float32)
    size_mb = update.payload.nbytes / 2**20
    log(f"[qerl] bench sync: {args.model}, LoRA r{args.lora_rank} ({size_mb:,.1f} MB in the engine's dtype), "
        f"{args.workers} workers, engine core {args.engine_core}")
    memory, disk = [], []  # (end-to-end ms, slowest worker's own ms) per repeat
    phases: list[dict[str, float]] = []  # the slowest worker's in-memory load, phase by phase
    try:
        with tempfile.TemporaryDirectory(prefix="qerl-sync-") as scratch:
            for index in range(args.repeats + 1):  # the first of each is a warm-up
                version = 2 * index + 1
                started = time.perf_counter()
                worker_ms = pool.update_adapter(ray.put(replace(update, version=version)))
                memory.append(((time.perf_counter() - started) * 1e3, max(worker_ms)))
                slowest = pool.workers[worker_ms.index(max(worker_ms))]
                phases.append(ray.get(slowest.last_load_phases.remote()))
                started = time.perf_counter()
                path = write_peft_folder(update, Path(scratch) / f"v{version + 1}")
                worker_ms = ray.get([w.load_adapter_from_disk.remote(str(path), version + 1) for w in pool.workers])
                disk.append(((time.perf_counter() - started) * 1e3, max(worker_ms)))
    finally:
        pool.shutdown()
        if started_ray:
            ray.shutdown()
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
    result = {"benchmark": "sync", "args": args.__dict__, "environment": environment_facts(),
              "adapter_mb": size_mb, "rows": rows, "in_memory_phase_p50_ms": phase_p50}
    write_json(args.json, result, log)
    return result

"""`qerl bench rollout`: generated tokens/s of one vLLM rollout worker (a Ray actor, with a LoRA
adapter loaded from memory, as in training) across a concurrency sweep, and, in the same run on
the same prompts, of the peer a user would otherwise use: Hugging Face `generate` on the same
base with the same peft adapter. Every request runs to max_tokens (ignore_eos), so random
weights measure real speed. The rollout settings (format, dtype, engine core, LoRA kernels...)
are the config's.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ray

from benchmarks.common import (
    environment_facts,
    model_label,
    print_table,
    resolve_bench_model,
    weight_bytes,
    write_json,
)
from benchmarks.peer import hf_generate_throughput
from benchmarks.random_adapter import random_adapter
from benchmarks.shapes import quantized_shape_folder
from benchmarks.workers import BenchWorker, bench_rollout_config, started_ray
from learner.policy import PACKED_SCHEMES, packed_folder
from rollout_server.pool import RolloutPool
from rollout_server.vllm_internals import serving_problem
from shared.config import QerlConfig, RolloutConfig
from shared.errors import QerlError
from shared.formats import DTYPES, POLICY_FORMATS
from shared.types import SamplingSettings, ServedBase


@dataclass(frozen=True)
class RolloutBenchArgs:
    shape: str | None = None
    concurrency: tuple[int, ...] = (16, 64, 256)
    prompt_len: int | None = None
    """None: 256, or a quarter of the model's context where that is shorter."""
    gen_len: int | None = None
    """None: 512, or half of the model's context where that is shorter."""
    formats: tuple[str, ...] = ()
    """Policy formats to measure one after another, each on its own engine (); empty: the
    config's policy.format. Ratios are to the first."""
    no_adapter: bool = False
    repeats: int = 3
    """Timed vLLM runs per concurrency, after two short untimed ones; the table gives the median
    with every run listed (one run can catch a stall). The slow HF peer runs once."""
    peer_concurrency: tuple[int, ...] = (16, 64)
    peer_gen_len: int | None = None
    """Tokens the HF peer generates; None: the same as gen_len (a fair comparison)."""
    peer_format: str = "nf4"
    profile: str | None = None
    """Folder: after the sweep, profile one generate of `profile_seqs` sequences (up to 128
    generated tokens, to keep the trace small) and write its op table there."""
    profile_seqs: int = 64
    json: str | None = None


WARMUP_TOKENS = 32
"""Tokens each untimed warm-up generate runs, per concurrency, before the timed runs."""


def sequence_lengths(args_prompt: int | None, args_gen: int | None, context: int) -> tuple[int, int]:
    """(prompt, generated) tokens per sequence: the asked ones, or defaults that fit `context`."""
    prompt = args_prompt or min(256, context // 4)
    gen = args_gen or min(512, context // 2)
    if prompt + gen + 16 > context:
        raise QerlError(f"--prompt-len {prompt} + --gen-len {gen} (+16) exceed the model's context of {context} tokens")
    return prompt, gen


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def bench_served_base(folder: Path, shape: str | None, policy_format: str, config: QerlConfig) -> ServedBase:
    """What an engine serves for `policy_format`: for a shape, random weights in that layout
    (vLLM's dummy load of a config-only folder); for a model folder, the folder itself, its
    cached 4-bit copy, or vLLM's own quantization of it."""
    pair = POLICY_FORMATS[policy_format]
    if pair.engine in PACKED_SCHEMES:
        if shape is not None:
            return ServedBase(str(quantized_shape_folder(shape, pair.engine, config.policy.group_size)), None,
                              policy_format)
        engine_dtype = config.rollout.engine_dtype(policy_format)
        return ServedBase(str(packed_folder(folder, pair.engine, config.policy, engine_dtype)), None, policy_format)
    return ServedBase(str(folder), pair.vllm_quantization, policy_format)


def bench_rollout(config: QerlConfig, args: RolloutBenchArgs, log=print) -> dict:
    from transformers import AutoConfig

    if args.profile and not config.rollout.in_process:
        raise QerlError("--profile needs rollout.in_process=true: the profiler sees only the worker's own process")
    formats = args.formats or (config.policy.format,)
    folder, is_random = resolve_bench_model(args.shape, config)
    model_config = AutoConfig.from_pretrained(folder)
    prompt_len, gen_len = sequence_lengths(args.prompt_len, args.gen_len, model_config.max_position_embeddings)
    rollout = bench_rollout_config(config.rollout, is_random, prompt_len + gen_len + 16)
    for policy_format in formats:
        _check_servable(policy_format, rollout)
    n, rank = rollout.samples_per_prompt, config.lora.rank
    log(f"[qerl] bench rollout: {model_label(args.shape, folder)}, formats {', '.join(formats)}, "
        f"{'no adapter' if args.no_adapter else f'LoRA r{rank}'}, prompt {prompt_len}, gen {gen_len}, n={n}, "
        f"engine core {'in process' if rollout.in_process else 'separate'}, linear backend {rollout.linear_backend}, "
        f"LoRA dual stream {'on' if rollout.lora_dual_stream else 'off'}, "
        f"request seeds {'on' if rollout.request_seeds else 'off'}, "
        f"LoRA kernels {rollout.lora_kernel_configs or 'vLLM defaults'}, KV cache {rollout.kv_cache_dtype}")
    adapter = None if args.no_adapter else random_adapter(folder, rank)
    rows, profile, bandwidth, device = [], None, None, None
    with started_ray(rollout):
        for policy_format in formats:
            served = bench_served_base(folder, args.shape, policy_format, config)
            pool = RolloutPool(served, rollout, rank, log=log, worker_class=BenchWorker)
            worker = pool.live_workers()[0]
            try:
                if adapter is not None:
                    pool.update_adapter(adapter)
                kernels = ray.get(worker.linear_kernels.remote())
                schedule = ray.get(worker.engine_schedule.remote())
                log(f"[qerl]   {policy_format}: linear layers served by {', '.join(kernels) or 'no quantized kernel'}; "
                    f"CUDA graphs {schedule['cudagraph_mode']}, async scheduling "
                    f"{'on' if schedule['async_scheduling'] else 'off'}")
                for seqs in args.concurrency:
                    row = _timed_concurrency(pool, seqs, n, prompt_len, gen_len, model_config.vocab_size, args.repeats,
                                             log)
                    rows.append({"format": policy_format, "kernels": kernels, **schedule, **row})
                device = ray.get(worker.device.remote())
                bandwidth = bandwidth or ray.get(worker.copy_bandwidth.remote())
                if args.profile:
                    profile = profile or {}
                    profile[policy_format] = _profile(worker, args, n, prompt_len, gen_len, model_config.vocab_size,
                                                      f"{args.profile}/{policy_format}", log)
            finally:
                pool.shutdown()
    _add_floors_and_ratios(rows, folder, bandwidth, formats, config)
    peers = {}
    if args.peer_concurrency:
        peers = hf_generate_throughput(folder, is_random, args.peer_format, adapter, args.peer_concurrency, n,
                                       prompt_len, args.peer_gen_len or gen_len, model_config.vocab_size, log)
    for row in rows:
        peer = peers.get(row["seqs"])
        row["peer_tok_per_s"] = peer
        row["ratio_to_peer"] = row["tok_per_s"] / peer if peer else None
    print_table(
        ["format", "seqs", "tok/s", f"vs {formats[0]}", "HF peer tok/s", "vs peer", "floor tok/s"],
        [[r["format"], r["seqs"], r["tok_per_s"], r["ratio_to_first"], r["peer_tok_per_s"], r["ratio_to_peer"],
          r["floor_tok_per_s"]] for r in rows],
        log,
    )
    log(f"[qerl] floor: weight bytes of a decode step / {bandwidth / 1e9:,.0f} GB/s measured copy bandwidth on the "
        f"worker's {device}")
    result = {"benchmark": "rollout", "args": asdict(args), "config": config.model_dump(), "formats": list(formats),
              "prompt_len": prompt_len, "gen_len": gen_len, "environment": environment_facts(),
              "bandwidth_bytes_per_s": bandwidth, "rows": rows,
              "peer": {"format": args.peer_format, "gen_len": args.peer_gen_len or gen_len,
                       "tok_per_s": {str(k): v for k, v in peers.items()}}, "profile": profile}
    write_json(args.json, result, log)
    return result


def _check_servable(policy_format: str, rollout: RolloutConfig) -> None:
    if policy_format not in POLICY_FORMATS:
        raise QerlError(f"--formats {policy_format}: not one of {', '.join(POLICY_FORMATS)}")
    problem = serving_problem(policy_format, rollout)
    if problem:
        raise QerlError(problem)


def _add_floors_and_ratios(rows: list[dict], folder: Path, bandwidth: float, formats: tuple[str, ...],
                           config: QerlConfig) -> None:
    """Each row's memory-bandwidth floor (weight bytes per decode step / bandwidth) and its
    tok/s relative to the first format's at the same concurrency (same run, same prompts)."""
    first = {r["seqs"]: r["tok_per_s"] for r in rows if r["format"] == formats[0]}
    for row in rows:
        pair = POLICY_FORMATS[row["format"]]
        served = pair.engine if pair.engine != "learner" else DTYPES[config.rollout.engine_dtype(row["format"])].short
        step_floor_s = weight_bytes(folder, served) / bandwidth
        row["decode_step_floor_ms"] = step_floor_s * 1e3
        row["floor_tok_per_s"] = row["seqs"] / step_floor_s
        row["ratio_to_first"] = row["tok_per_s"] / first[row["seqs"]] if row["seqs"] in first else None


def _profile(worker, args: RolloutBenchArgs, n: int, prompt_len: int, gen_len: int, vocab: int, out_dir: str,
             log) -> dict:
    prompts = random_prompts(max(1, args.profile_seqs // n), prompt_len, vocab, args.profile_seqs)
    steps = min(gen_len, 128)
    sampling = SamplingSettings(n, 1.0, steps, seed=args.profile_seqs, ignore_eos=True)
    profile = ray.get(worker.profile_generate.remote(prompts, sampling, steps, out_dir))
    profile["seqs"] = args.profile_seqs  # --profile-seqs, not the sweep's --concurrency
    log(profile["line"].replace("[qerl] profile:", f"[qerl] profile of {args.profile_seqs} sequences:", 1))
    return profile


def _timed_concurrency(pool: RolloutPool, seqs: int, n: int, prompt_len: int, gen_len: int, vocab: int,
                       repeats: int, log) -> dict:
    prompts = random_prompts(max(1, seqs // n), prompt_len, vocab, seqs)
    # Short untimed passes at this batch's shapes first: with tuned LoRA kernel configs the first
    # timed runs at a new batch size ran far slower than the later ones on the H200, and a median
    # of 3 cannot hide two. Twice: the second pass finds the prompts in the prefix cache, as every
    # timed run does.
    for _ in range(2):
        pool.generate(prompts, SamplingSettings(n, 1.0, WARMUP_TOKENS, seed=seqs, ignore_eos=True))
    runs, tokens, versions = [], [], set()
    for repeat in range(repeats):
        sampling = SamplingSettings(n, 1.0, gen_len, seed=seqs + repeat, ignore_eos=True)
        started = time.perf_counter()
        completions = pool.generate(prompts, sampling)
        elapsed = time.perf_counter() - started
        tokens.append(sum(len(c.token_ids) for c in completions))
        versions |= {c.adapter_version for c in completions}
        runs.append(tokens[-1] / elapsed)
    log(f"[qerl]   vLLM {len(completions)} seqs: {statistics.median(runs):,.0f} tok/s "
        f"(runs: {', '.join(f'{r:,.0f}' for r in runs)})")
    return {"seqs": len(completions), "tok_per_s": statistics.median(runs), "tok_per_s_runs": runs,
            "tokens_per_run": tokens, "adapter_versions": sorted(versions)}

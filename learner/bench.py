"""`qerl bench learner`: tokens/s and peak memory of one learner training step, by base format
(NF4 vs bf16) and micro-batch size, on the same random batch."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from learner.actor import Learner
from learner.model import benchmark_base
from shared.bench_utils import environment_facts, percentile, print_table, resolve_bench_model, sync_device, write_json
from shared.config import LearnerConfig, LoraConfig
from shared.types import TrainSample


@dataclass(frozen=True)
class LearnerBenchArgs:
    model: str = "tiny"
    formats: tuple[str, ...] = ("nf4", "bf16")
    micro_batches: tuple[int, ...] = (1, 4, 16)
    prompt_len: int = 256
    gen_len: int = 512
    lora_rank: int = 32
    repeats: int = 2
    json: str | None = None


def _random_samples(count: int, prompt_len: int, gen_len: int, vocab: int) -> list[TrainSample]:
    rng = random.Random(count)
    return [
        TrainSample(
            prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt_len)],
            completion_ids=[rng.randrange(3, vocab) for _ in range(gen_len)],
            rollout_logprobs=[-1.0] * gen_len,
            advantage=rng.choice([-1.0, 1.0]),
        )
        for _ in range(count)
    ]


def _peak_memory_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def _export_ms(learner: Learner, dtype: torch.dtype, device: str, repeats: int = 5) -> float:
    """Median time for the learner to turn its LoRA into the rollout payload (engine dtype)."""
    learner.adapter_dtype = dtype
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        sync_device(device)
        started = time.perf_counter()
        learner.export_adapter()
        times.append((time.perf_counter() - started) * 1e3)
    return percentile(times[1:], 50)


def bench_learner(args: LearnerBenchArgs, log=print) -> dict:
    folder, is_random = resolve_bench_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    compute = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for base_format in args.formats:
        base = benchmark_base(folder, is_random, base_format, device, compute)
        vocab = base.config.vocab_size
        learner = Learner.from_base(base, LoraConfig(rank=args.lora_rank, alpha=2 * args.lora_rank),
                                    LearnerConfig(micro_batch_size=max(args.micro_batches), warmup_steps=0))
        export_ms = _export_ms(learner, compute, device)
        log(f"[qerl]   {base_format} adapter export ({compute}): {export_ms:,.1f} ms")
        for micro_batch in args.micro_batches:
            samples = _random_samples(micro_batch, args.prompt_len, args.gen_len, vocab)
            learner.train_step(samples, 1.0)  # warm-up: allocator, kernels
            sync_device(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            for _ in range(args.repeats):
                learner.train_step(samples, 1.0)
            sync_device(device)
            step_s = (time.perf_counter() - started) / args.repeats
            tokens = micro_batch * (args.prompt_len + args.gen_len)
            rows.append({"base": base_format, "micro_batch": micro_batch, "tok_per_s": tokens / step_s,
                         "step_ms": step_s * 1e3, "peak_gib": _peak_memory_gib(device), "export_ms": export_ms})
            log(f"[qerl]   {base_format} micro-batch {micro_batch}: {tokens / step_s:,.0f} tok/s")
        del learner, base
        if device == "cuda":
            torch.cuda.empty_cache()
    print_table(["base", "micro-batch", "tok/s", "step ms", "peak GiB", "adapter export ms"],
                [[r["base"], r["micro_batch"], r["tok_per_s"], r["step_ms"], r["peak_gib"], r["export_ms"]]
                 for r in rows], log)
    result = {"benchmark": "learner", "args": args.__dict__, "environment": environment_facts(), "rows": rows}
    write_json(args.json, result, log)
    return result

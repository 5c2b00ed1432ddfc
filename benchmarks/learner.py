"""`qerl bench learner`: tokens/s, MFU and peak memory of one learner training step, by base
format and micro-batch size, on the same random batch; LoRA and learner settings come from the
config.

Packed formats (int4, NVFP4, W8A8) are built as `qerl train` builds their learner
(`learner.actor.build_learner`): for a named shape from random packed weights written once into
the qerl cache (the folder `qerl bench step` serves), else from the model folder quantized the
way the pair quantizes it. fp32, bf16 and NF4 bases of a shape get random weights in memory.
MFU is the step's GEMM FLOPs (`benchmarks.common.learner_gemm_flops`) over its time and the bf16
GEMM rate this GPU reaches."""

from __future__ import annotations

import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import (
    environment_facts,
    gemm_floor_tflops,
    learner_gemm_flops,
    model_label,
    percentile,
    print_table,
    resolve_bench_model,
    sync_device,
    write_json,
)
from benchmarks.random_base import benchmark_base
from benchmarks.rollout import sequence_lengths
from learner.actor import Learner, LearnerSpec, build_learner
from learner.model import add_lora
from learner.policy import PACKED_SCHEMES
from shared.config import LearnerConfig, QerlConfig
from shared.errors import QerlError
from shared.formats import LEARNER_BASE_FORMATS
from shared.types import TrainSample


@dataclass(frozen=True)
class LearnerBenchArgs:
    shape: str | None = None
    formats: tuple[str, ...] = ("nf4", "bf16")
    micro_batches: tuple[int, ...] = (1, 4, 16)
    prompt_len: int | None = None
    gen_len: int | None = None
    repeats: int = 2
    profile: str | None = None
    """Folder: also profile one step at the largest micro-batch (device time by kernel kind)."""
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


def _frozen_gib(model) -> float:
    """The frozen base's weights and buffers as the learner holds them (packed, NF4 or dense)."""
    frozen = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in frozen) / 2**30


def _export_ms(learner: Learner, device: str, repeats: int = 5) -> float:
    """Median time for the learner to turn its LoRA into the rollout payload (engine dtype)."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        sync_device(device)
        started = time.perf_counter()
        learner.export_adapter()
        times.append((time.perf_counter() - started) * 1e3)
    return percentile(times[1:], 50)


def bench_learner(config: QerlConfig, args: LearnerBenchArgs, log=print) -> dict:
    from transformers import AutoConfig

    unknown = [f for f in args.formats if f not in LEARNER_BASE_FORMATS]
    if unknown:
        raise QerlError(f"--formats {','.join(unknown)}: the learner holds {', '.join(LEARNER_BASE_FORMATS)}")
    folder, is_random = resolve_bench_model(args.shape, config)
    context = AutoConfig.from_pretrained(folder).max_position_embeddings
    prompt_len, gen_len = sequence_lengths(args.prompt_len, args.gen_len, context)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    compute = torch.bfloat16 if device == "cuda" else torch.float32
    lora = config.lora
    log(f"[qerl] bench learner: {model_label(args.shape, folder)}, LoRA r{lora.rank}, prompt {prompt_len}, "
        f"gen {gen_len}, device {device}")
    floor = gemm_floor_tflops()
    rows = []
    for base_format in args.formats:
        learner_config = config.learner.model_copy(update={"micro_batch_size": max(args.micro_batches),
                                                            "warmup_steps": 0, "mini_batches": 1})
        learner, weights_folder = _learner(config, learner_config, args.shape, folder, is_random, base_format,
                                           device, compute)
        vocab = learner.model.config.vocab_size
        export_ms = _export_ms(learner, device)
        log(f"[qerl]   {base_format} adapter export ({compute}): {export_ms:,.1f} ms")
        for micro_batch in args.micro_batches:
            samples = _random_samples(micro_batch, prompt_len, gen_len, vocab)
            learner.train_step(samples, 1.0)  # warm-up: allocator, kernels
            sync_device(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            stats = [learner.train_step(samples, 1.0) for _ in range(args.repeats)]
            sync_device(device)
            step_s = (time.perf_counter() - started) / args.repeats
            tokens = micro_batch * (prompt_len + gen_len)
            recompute = bool(stats[-1]["learner/gradient_checkpointing"])
            tflops = learner_gemm_flops(weights_folder, tokens, micro_batch * gen_len, recompute) / step_s / 1e12
            rows.append({"base": base_format, "micro_batch": micro_batch, "tokens": tokens,
                         "tok_per_s": tokens / step_s, "step_ms": step_s * 1e3, "peak_gib": _peak_memory_gib(device),
                         "gradient_checkpointing": recompute, "compiled_layers": learner.compiled_layers,
                         "base_gib": _frozen_gib(learner.model),
                         "tflops": tflops, "mfu": tflops / floor if floor else None,
                         "export_ms": export_ms, "loss_finite": all(math.isfinite(s["learner/loss"]) for s in stats),
                         "grad_norm": stats[-1]["learner/grad_norm"]})
            mfu = "" if rows[-1]["mfu"] is None else f", MFU {rows[-1]['mfu']:.1%}"
            log(f"[qerl]   {base_format} micro-batch {micro_batch}: {tokens / step_s:,.0f} tok/s, "
                f"{step_s * 1e3:,.0f} ms{mfu}")
        if args.profile:
            from benchmarks.profile import profile_generate

            # no name left holding the learner: the next format's peak memory must not count it
            summary = profile_generate(partial(learner.train_step, samples, 1.0), 1, f"{args.profile}/{base_format}",
                                       unit="learner step")
            rows[-1]["profile"] = summary
            log(summary["line"])
        del learner
        torch._dynamo.reset()  # the next format compiles afresh, as in a learner process of its own
        if device == "cuda":
            torch.cuda.empty_cache()
    first = {}
    for row in rows:  # time against the first format's at the same micro-batch
        first.setdefault(row["micro_batch"], row["step_ms"])
        row["step_vs_first"] = row["step_ms"] / first[row["micro_batch"]]
    print_table(["base", "micro-batch", "tok/s", "step ms", "vs first", "MFU", "peak GiB", "adapter export ms"],
                [[r["base"], r["micro_batch"], r["tok_per_s"], r["step_ms"], f"{r['step_vs_first']:.2f}",
                  "-" if r["mfu"] is None else f"{r['mfu']:.1%}", r["peak_gib"], r["export_ms"]] for r in rows], log)
    result = {"benchmark": "learner", "args": asdict(args), "config": config.model_dump(), "gemm_floor_tflops": floor,
              "environment": environment_facts(), "prompt_len": prompt_len, "gen_len": gen_len, "rows": rows}
    write_json(args.json, result, log)
    return result


def _learner(config: QerlConfig, learner_config: LearnerConfig, shape: str | None, folder, is_random: bool,
             base_format: str, device: str, compute) -> tuple[Learner, Path]:
    """The learner of `base_format` and the folder its weights' shapes are read from."""
    lora = config.lora
    if base_format not in PACKED_SCHEMES:
        base = benchmark_base(folder, is_random, base_format, device, compute)
        return Learner(add_lora(base, lora.rank, lora.alpha, lora.target_modules), learner_config, compute), folder
    from benchmarks.shapes import random_packed_shape_folder

    group_size = config.policy.group_size
    source = random_packed_shape_folder(shape, base_format, group_size) if shape else folder
    rollout_dtype = "bfloat16" if device == "cuda" else config.rollout.engine_dtype(base_format)
    with tempfile.TemporaryDirectory(prefix="qerl-bench-learner-") as run_dir:  # exact pairs write nothing there
        spec = LearnerSpec(str(source), lora, learner_config, run_dir,
                           config.policy.model_copy(update={"format": base_format}), rollout_dtype,
                           config.train.seed, device)
        return build_learner(spec, log=lambda *_: None), source

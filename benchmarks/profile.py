"""Where a rollout's decode time goes: one generate under torch.profiler (`qerl bench rollout
--profile DIR`), run inside the worker's process with the engine core in it.

It reports, per decode step, the device time by kind of kernel (GEMM, attention, LoRA, ...)
and how much of the wall time the GPU was busy at all: a step far from its weight-read floor
is either slow kernels or a device waiting for the host, and this tells which.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# First match wins; names are CUDA kernel names as the profiler records them. Inductor names its
# own kernels (triton_poi_ pointwise, triton_red_ reduction, triton_per_ persistent reduction)
# after the ops they fuse, including ops they only feed ("..._cutlass_scaled_mm"): they are
# classified by those ops before the GEMM rule, and never count as GEMMs.
INDUCTOR = r"^triton_(poi|red|per)_"
KERNEL_KINDS = [
    ("lora", re.compile(r"lora", re.I)),
    ("attention", re.compile(r"flash|attn|attention|fmha|paged", re.I)),
    # the learner's rebuild of packed 4-bit weights: its Triton kernels (learner.packed_kernels), or
    # Inductor's fused unpacking (shifts and masks)
    ("4-bit rebuild", re.compile(r"rshift|bitwise_and|rebuild", re.I)),
    # a W8A8 engine's per-token fp8 rounding, which Inductor fuses with the norm or SiLU before it
    ("fp8 quantization", re.compile(INDUCTOR + r"\w*abs\w*clamp", re.I)),
    ("sampling", re.compile(r"softmax|topk|top_k|sort|multinomial|exponential|argmax|log_softmax|gumbel", re.I)),
    ("norm/activation", re.compile(r"norm|silu|act_and_mul|rotary|rope|rsqrt|sigmoid", re.I)),
    ("fused elementwise", re.compile(INDUCTOR, re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|cublas|matmul|sm90_xmma|nvjet|splitk|marlin|machete|wna16", re.I)),
    ("copy/fill", re.compile(r"copy|fill|memset|memcpy|cat|index", re.I)),
]


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def _device_intervals(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every device kernel the profiler saw."""
    from torch.autograd import DeviceType

    return [
        (event.name, event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type == DeviceType.CUDA and event.time_range.end > event.time_range.start
    ]


def busy_us(intervals: list[tuple[str, float, float]]) -> float:
    """Length of the union of the intervals: time the device ran at least one kernel."""
    total, reach = 0.0, float("-inf")
    for _, start, end in sorted(intervals, key=lambda item: item[1]):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def profile_generate(generate, steps: int, out_dir: str | Path, unit: str = "decode step") -> dict:
    """Run `generate()` under the profiler; write the op table to out_dir/ops.txt and return
    the summary (device ms per `unit` by kind, GPU-busy share of the wall time) with a
    readable `line`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        generate()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - started) * 1e6
    sort_key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    (out / "ops.txt").write_text(prof.key_averages().table(sort_by=sort_key, row_limit=60) + "\n")
    intervals = _device_intervals(prof)
    by_kind: dict[str, float] = {}
    launches: dict[str, int] = {}  # many short kernels cost launch gaps that device time hides
    for name, start, end in intervals:
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (end - start)
        launches[kind] = launches.get(kind, 0) + 1
    summary = {
        "wall_ms": wall_us / 1e3,
        "steps": steps,
        "wall_ms_per_step": wall_us / 1e3 / steps,
        "device_busy_share": busy_us(intervals) / wall_us if intervals else None,
        "device_ms_per_step": {kind: us / 1e3 / steps for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernels_per_step": {kind: launches[kind] / steps for kind in sorted(by_kind, key=lambda k: -by_kind[k])},
        "ops_table": str(out / "ops.txt"),
    }
    summary["line"] = (f"[qerl] profile: {summary['wall_ms_per_step']:.2f} ms per {unit} (wall), "
        + (f"device busy {summary['device_busy_share']:.0%} of it; device ms per step: "
           + ", ".join(f"{kind} {ms:.2f} ({launches[kind] / steps:.0f} kernels)"
                       for kind, ms in summary["device_ms_per_step"].items())
           if intervals else "no device kernels recorded (it ran on the CPU)")
        + f"; op table: {out / 'ops.txt'}")
    return summary

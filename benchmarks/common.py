"""Helpers every benchmark uses: model resolution, memory-bandwidth floor, percentiles, tables."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from shared.config import QerlConfig
from shared.errors import QerlError
from shared.formats import BASE_FORMATS, POLICY_FORMATS


def resolve_bench_model(shape: str | None, config: QerlConfig) -> tuple[Path, bool]:
    """(folder, random weights?): a named shape (random weights), else the config's
    model.path, else the embedded tiny model."""
    from benchmarks.shapes import shape_folder
    from learner.model import check_model_folder
    from shared.tiny_model import tiny_model_path

    if shape is not None:
        return shape_folder(shape), True
    if config.model.path is not None:
        return check_model_folder(config.model.path), False
    return tiny_model_path(), False


def model_label(shape: str | None, folder: Path) -> str:
    return f"{shape} (random weights)" if shape else folder.name


def weight_bytes(model_folder: Path, base_format: str) -> float:
    """Bytes one decode step must read: linear layers in `base_format`, the rest in 16/32-bit."""
    from transformers import AutoConfig

    from benchmarks.random_adapter import linear_layer_shapes

    config = AutoConfig.from_pretrained(model_folder)
    linear = sum(fan_in * fan_out for fan_in, fan_out in linear_layer_shapes(model_folder).values())
    embed = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    other_bytes = 4.0 if base_format == "fp32" else 2.0
    return linear * BASE_FORMATS[base_format].linear_bytes + embed * other_bytes


def copy_bandwidth(device: str, megabytes: int = 1024, repeats: int = 10) -> float:
    """Measured device memory bandwidth in bytes/s (a copy reads and writes every byte)."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    sync_device(device)
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    sync_device(device)
    return 2 * source.numel() * repeats / (time.perf_counter() - started)


def sync_device(device: str) -> None:
    """Wait for queued GPU work, so that wall-clock timings cover it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def check_policy_formats(formats: tuple[str, ...]) -> None:
    """A one-line error naming every --formats entry that is not a policy format."""
    unknown = [f for f in formats if f not in POLICY_FORMATS]
    if unknown:
        raise QerlError(f"--formats {','.join(unknown)}: not one of {', '.join(POLICY_FORMATS)}")


def logprob_gap(diffs: list[float]) -> dict:
    """Per-token logprob differences d between two scorings of the same tokens: their count, the
    KL estimated as exp(d) - 1 - d (mean and max), and |d| (mean and max)."""
    kls = [math.exp(d) - 1 - d for d in diffs]
    return {"tokens": len(diffs), "kl_mean": sum(kls) / len(kls), "kl_max": max(kls),
            "abs_diff_mean": sum(abs(d) for d in diffs) / len(diffs), "abs_diff_max": max(abs(d) for d in diffs)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def print_table(headers: list[str], rows: list[list], log=print) -> None:
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    log("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        log("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def write_json(path: str | None, payload: dict, log=print) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        log(f"[qerl] results: {path}")


def environment_facts() -> dict:
    import platform

    import transformers
    import vllm

    facts = {"torch": torch.__version__, "vllm": vllm.__version__, "transformers": transformers.__version__,
             "python": platform.python_version()}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
    else:
        facts["cpu"] = platform.processor() or platform.machine()
    return facts


def gemm_floor_tflops() -> float | None:
    """bf16 TFLOP/s of a 4096 x 3584 x 18944 GEMM on this GPU (a subprocess: no CUDA context
    stays in the driver); None without a GPU."""
    if not torch.cuda.is_available():
        return None
    code = ("import torch, time\n"
            "a = torch.randn(4096, 3584, device='cuda', dtype=torch.bfloat16)\n"
            "b = torch.randn(3584, 18944, device='cuda', dtype=torch.bfloat16)\n"
            "for _ in range(5): a @ b\n"
            "torch.cuda.synchronize(); t = time.perf_counter()\n"
            "for _ in range(50): a @ b\n"
            "torch.cuda.synchronize(); print(2 * 4096 * 3584 * 18944 * 50 / (time.perf_counter() - t) / 1e12)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return float(done.stdout.split()[-1]) if done.returncode == 0 else None


def learner_gemm_flops(folder: Path, sequence_tokens: float, completion_tokens: float, recompute: bool) -> float:
    """The learner step's GEMM FLOPs: linear layers 2 (forward) + 2 (input gradient) + 2 (recompute,
    with gradient checkpointing) FLOPs per weight and real token, the vocabulary projection 6 per
    completion token."""
    from transformers import AutoConfig

    from benchmarks.random_adapter import linear_layer_shapes

    config = AutoConfig.from_pretrained(folder)
    linear = sum(fan_in * fan_out for fan_in, fan_out in linear_layer_shapes(folder).values())
    head = config.hidden_size * config.vocab_size
    per_weight = 6 if recompute else 4
    return per_weight * linear * sequence_tokens + 6 * head * completion_tokens

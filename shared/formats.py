"""The one table of dtypes and base formats: the config, the learner, the rollout workers, the
adapter payload and the benchmarks all read names from here.

A dtype has one config spelling ("float32", "bfloat16", "float16"), a short name used in
tables and logs, its torch dtype and its safetensors code. A base format says how a side holds
the frozen base weights and how many bytes per weight its linear layers read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dtype:
    name: str
    """Config and vLLM spelling."""
    short: str
    torch: torch.dtype
    safetensors: str


DTYPES: dict[str, Dtype] = {
    d.name: d
    for d in (
        Dtype("float32", "fp32", torch.float32, "F32"),
        Dtype("bfloat16", "bf16", torch.bfloat16, "BF16"),
        Dtype("float16", "fp16", torch.float16, "F16"),
    )
}
DTYPE_NAMES = tuple(DTYPES)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {d.safetensors: d.torch for d in DTYPES.values()}


def dtype_of(name: str) -> torch.dtype:
    return DTYPES[name].torch


def safetensors_code(dtype: torch.dtype) -> str:
    return next(d.safetensors for d in DTYPES.values() if d.torch == dtype)


@dataclass(frozen=True)
class BaseFormat:
    """How one side holds the frozen base."""

    name: str
    linear_bytes: float
    """Bytes per weight of a linear layer (4-bit: packed values plus group scales)."""
    vllm_quantization: str | None = None
    """vLLM's `quantization` argument when an engine serves this format itself."""
    learner: bool = False
    """The learner can hold the base in this format."""


BASE_FORMATS: dict[str, BaseFormat] = {
    f.name: f
    for f in (
        BaseFormat("fp32", 4.0, learner=True),
        BaseFormat("bf16", 2.0, learner=True),
        BaseFormat("fp16", 2.0),
        BaseFormat("nf4", 0.53, learner=True),
        BaseFormat("fp8", 1.0, vllm_quantization="fp8"),
        BaseFormat("bitsandbytes", 0.53, vllm_quantization="bitsandbytes"),
    )
}
LEARNER_BASE_FORMATS = tuple(name for name, f in BASE_FORMATS.items() if f.learner)
ENGINE_QUANTIZATIONS = tuple(f.vllm_quantization for f in BASE_FORMATS.values() if f.vllm_quantization)


def learner_dtype(base_format: str) -> torch.dtype:
    """The dtype a learner base of `base_format` is loaded in (NF4 computes in the engine dtype)."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16}.get(base_format, torch.float32)

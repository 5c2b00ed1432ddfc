"""The GPU rebuild of packed 4-bit weights: one Triton kernel per format, launched directly.

`learner.packed_layers` rebuilds a packed layer's dense weight two or three times a micro-batch
(forward, backward, and the recompute where checkpointing is on), inside the `packed_matmul`
custom op. A plain Triton launch spares the host dynamo's guards and AOTAutograd's wrappers,
which a `torch.compile`d rebuild pays on every call. On the device the kernels work in tiles
shaped like the packing (int4: rows x words x codes; NVFP4: rows x groups x 16 values), with
32-bit offsets: each packed word and each scale is loaded once, no weight needs a division or
modulo, NVFP4 divides each group's scale by the global scale once, not once per weight, and each
tile's innermost axis is at least 8 contiguous outputs, so stores are 16-byte vectors. The first,
flat version of these kernels took longer on the device than the compiled rebuild (BENCHMARKS.md,
H100 2026-12-07).

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

TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round_to(value, dtype: tl.constexpr):
    """fp32 -> `dtype`, to nearest even (what a PyTorch cast does), spelled out for Triton's interpreter."""
    if dtype == tl.float32:
        return value
    return value.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _rows(rows_total, block_rows: tl.constexpr, wide: tl.constexpr):
    """This program's rows, in 64 bits only where an offset could pass 2**31 (`wide`)."""
    rows = tl.program_id(0) * block_rows + tl.arange(0, block_rows)
    return rows.to(tl.int64) if wide else rows


@triton.jit
def _int4_rebuild_kernel(qweight_ptr, scale_ptr, out_ptr, rows_total, in_features, words_per_row,
                         scales_per_row, group_size: tl.constexpr, scale_dtype: tl.constexpr,
                         out_dtype: tl.constexpr, block_rows: tl.constexpr, block_cols: tl.constexpr,
                         wide: tl.constexpr):
    # a 3-D tile (rows, packed words, the 8 codes of a word): each word and its scale are loaded
    # once and the codes shifted out of it, with no division or modulo per weight
    rows = _rows(rows_total, block_rows, wide)[:, None, None]
    words = (tl.program_id(1) * (block_cols // 8) + tl.arange(0, block_cols // 8))[None, :, None]
    nibbles = tl.arange(0, 8)[None, None, :]
    cols = words * 8 + nibbles
    word_mask = (rows < rows_total) & (words * 8 < in_features)
    # code i of an int32 word sits at bits 4i..4i+3, stored with +8 (compressed-tensors' pack_to_int32);
    # as a float without an int-to-float conversion: the bits of 2**23 + stored code, minus 2**23 + 8
    word = tl.load(qweight_ptr + rows * words_per_row + words, mask=word_mask, other=0)
    stored = (word >> (nibbles * 4)) & 0xF
    code = (stored | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    scale = tl.load(scale_ptr + rows * scales_per_row + words * 8 // group_size, mask=word_mask, other=0)
    # the product of a 4-bit code and a 16-bit scale is exact in fp32: rounding it once to the
    # scales' dtype is the reference's multiplication in that dtype (a second rounding to the
    # same dtype would change nothing)
    weight = _round_to(code * scale.to(tl.float32), scale_dtype)
    if out_dtype != scale_dtype:
        weight = _round_to(weight.to(tl.float32), out_dtype)
    tl.store(out_ptr + rows * in_features + cols, weight, mask=(rows < rows_total) & (cols < in_features))


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
    """4-bit e2m1 code -> fp32 (compressed-tensors' kE2M1ToFloat; bit 3 is the sign), built as fp32
    bits: exponent e and mantissa m give 2**(e - 1) * (1 + m / 2) for e > 0, m / 2 for e = 0."""
    magnitude = code & 0x7
    bits = tl.where(magnitude > 1, (magnitude << 22) + (126 << 23), tl.where(magnitude == 1, 126 << 23, 0))
    return (bits | ((code & 0x8) << 28)).to(tl.float32, bitcast=True)  # the sign bit: -0.0 for code 8


@triton.jit
def _nvfp4_rebuild_kernel(qweight_ptr, scale_ptr, global_scale_ptr, out_ptr, rows_total, in_features, bytes_per_row,
                          scales_per_row, out_dtype: tl.constexpr, block_rows: tl.constexpr,
                          block_cols: tl.constexpr, wide: tl.constexpr):
    # a 3-D tile (rows, groups of 16 weights, the 16 weights of a group): each of a group's 8 bytes
    # is loaded once and its low and high codes interleaved (tl.join), so the innermost 16 output
    # values are contiguous and stored as 16-byte vectors (a 4-D tile whose innermost axis was a
    # byte's 2 codes stored 4 bytes at a time and ran at a quarter of the memory floor); each
    # scale is decoded and divided once per group (one IEEE division per 16 weights)
    rows = _rows(rows_total, block_rows, wide)[:, None, None]
    groups = (tl.program_id(1) * (block_cols // 16) + tl.arange(0, block_cols // 16))[None, :, None]
    byte_index = groups * 8 + tl.arange(0, 8)[None, None, :]
    cols = groups * 16 + tl.arange(0, 16)[None, None, :]
    row_mask = rows < rows_total
    byte = tl.load(qweight_ptr + rows * bytes_per_row + byte_index, mask=row_mask & (byte_index * 2 < in_features),
                   other=0).to(tl.int32)
    # the low nibble first: code 2j is byte j's low half, code 2j + 1 its high half
    code = tl.reshape(tl.join(byte & 0xF, (byte >> 4) & 0xF), (block_rows, block_cols // 16, 16))
    scale_bits = tl.load(scale_ptr + rows * scales_per_row + groups, mask=row_mask & (groups < scales_per_row),
                         other=0)
    scale = tl.math.div_rn(_e4m3_to_float(scale_bits.to(tl.int32)), tl.load(global_scale_ptr))
    tl.store(out_ptr + rows * in_features + cols, _round_to(_e2m1_to_float(code) * scale, out_dtype),
             mask=row_mask & (cols < in_features))


# 8 x 256 weights a program: a row of the tile is 512 contiguous bytes of bf16 output
BLOCK_ROWS, BLOCK_COLS = 8, 256


def _launch(kernel, rows: int, in_features: int, *args) -> None:
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(in_features, BLOCK_COLS))
    wide = (rows + BLOCK_ROWS) * (in_features + BLOCK_COLS) >= 2**31  # the largest offset a tile computes
    kernel[grid](*args, block_rows=BLOCK_ROWS, block_cols=BLOCK_COLS, wide=wide)


def int4_rebuild(qweight: torch.Tensor, scale: torch.Tensor, in_features: int, group_size: int,
                 dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(qweight.shape[0], in_features, dtype=dtype, device=qweight.device)
    # rows of the packed tensors are read by their own widths: a row of codes may end in padding
    _launch(_int4_rebuild_kernel, out.shape[0], in_features, qweight.contiguous(), scale.contiguous(), out,
            out.shape[0], in_features, qweight.shape[1], scale.shape[1], group_size,
            TRITON_DTYPES[scale.dtype], TRITON_DTYPES[dtype])
    return out


def nvfp4_rebuild(qweight: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, in_features: int,
                  dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(qweight.shape[0], in_features, dtype=dtype, device=qweight.device)
    _launch(_nvfp4_rebuild_kernel, out.shape[0], in_features, qweight.contiguous(),
            scale.contiguous().view(torch.uint8), global_scale, out, out.shape[0], in_features, qweight.shape[1],
            scale.shape[1], TRITON_DTYPES[dtype])
    return out

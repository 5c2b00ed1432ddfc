"""The learner's Triton rebuild of packed 4-bit weights (`learner.packed_kernels`) against the
CPU reference, run by Triton's CPU interpreter where Triton is installed (the GPU tier compares
the compiled kernels bit for bit on a GPU: tests/integration/test_packed_rebuild_gpu.py).

The interpreter stores bf16 by truncation, not rounding to nearest as a GPU does, so this
compares the fp16 and fp32 outputs only; those take every step of the kernels' arithmetic (code
unpacking, group indexing, the e4m3 and e2m1 decoding, the IEEE division, the sign of zero)."""

from __future__ import annotations

from triton_checks import NEEDS_TRITON, assert_16_byte_stores, compile_for_hopper, run_under_interpreter

CHECK = r"""
import torch
from learner.packed_layers import Int4Linear, Nvfp4Linear, int4_weight, nvfp4_weight
from learner.packed_kernels import int4_rebuild, nvfp4_rebuild

generator = torch.Generator().manual_seed(0)
failures = []
# 24 x 256: whole tiles; 20 x 320: tiles cut at the last rows and columns
for (out_features, in_features) in ((24, 256), (20, 320)):
    for scale_dtype in (torch.float16, torch.float32):
        layer = Int4Linear(in_features, out_features, 64, scale_dtype)
        layer.qweight.copy_(torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, generator=generator,
                                          dtype=torch.int64).to(torch.int32))
        layer.scale.copy_(torch.rand(layer.scale.shape, generator=generator) * 0.02 + 1e-4)
        reference = int4_weight(layer.qweight, layer.scale, in_features, 64)
        for dtype in (torch.float16, torch.float32):
            got = int4_rebuild(layer.qweight, layer.scale, in_features, 64, dtype)
            if not torch.equal(got.view(torch.uint8), reference.to(dtype).view(torch.uint8)):
                failures.append(f"int4 {out_features}x{in_features} {scale_dtype} -> {dtype}")
for (out_features, in_features) in ((24, 256), (20, 320)):
    layer = Nvfp4Linear(in_features, out_features)
    layer.qweight.copy_(torch.randint(0, 256, layer.qweight.shape, generator=generator, dtype=torch.int32)
                        .to(torch.uint8))
    scales = torch.rand(layer.scale.shape, generator=generator) * 400 + 1
    scales[0, :4] = torch.tensor([0.001, 0.0005, -3.0, 0.0])  # subnormal, negative and zero scales
    layer.scale.copy_(scales.to(torch.float8_e4m3fn))
    layer.global_scale.fill_(1234.5)
    reference = nvfp4_weight(layer.qweight, layer.scale.to(torch.float32) / layer.global_scale, torch.float32)
    for dtype in (torch.float32, torch.float16):
        got = nvfp4_rebuild(layer.qweight, layer.scale, layer.global_scale, in_features, dtype)
        if not torch.equal(got.view(torch.uint8), reference.to(dtype).view(torch.uint8)):
            failures.append(f"nvfp4 {out_features}x{in_features} -> {dtype}")
assert not failures, failures
print("ok")
"""


@NEEDS_TRITON
def test_triton_rebuild_matches_the_reference_under_the_interpreter():
    run_under_interpreter(CHECK)


@NEEDS_TRITON
def test_triton_rebuild_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter runs the kernels' Python; this lowers them to sm_90 code with Triton's
    bundled ptxas, so a kernel that only the interpreter accepts fails here, not on a leased GPU.
    It also checks that every store of the output is a 16-byte vector, as the JIT compiles them for
    sizes divisible by 16 (all of Qwen2.5's): NVFP4's first tiled kernel stored 4 bytes at a time
    and ran at a quarter of the memory floor on an H100 (BENCHMARKS.md, H100 2026-12-07, midday)."""
    import triton.language as tl

    from learner import packed_kernels

    tiles = {"block_rows": packed_kernels.BLOCK_ROWS, "block_cols": packed_kernels.BLOCK_COLS, "wide": False}
    sizes = dict.fromkeys(("rows_total", "in_features", "scales_per_row"), "i32")
    int4 = {"qweight_ptr": "*i32", "scale_ptr": "*bf16", "out_ptr": "*bf16", **sizes, "words_per_row": "i32",
            **dict.fromkeys(("group_size", "scale_dtype", "out_dtype", *tiles), "constexpr")}
    nvfp4 = {"qweight_ptr": "*u8", "scale_ptr": "*u8", "global_scale_ptr": "*fp32", "out_ptr": "*bf16", **sizes,
             "bytes_per_row": "i32", **dict.fromkeys(("out_dtype", *tiles), "constexpr")}
    sources = {
        "int4": (packed_kernels._int4_rebuild_kernel, int4,
                 {"group_size": 128, "scale_dtype": tl.bfloat16, "out_dtype": tl.bfloat16, **tiles}),
        "nvfp4": (packed_kernels._nvfp4_rebuild_kernel, nvfp4, {"out_dtype": tl.bfloat16, **tiles}),
    }
    for name, (kernel, signature, constexprs) in sources.items():
        divisible = tuple(argument for argument, kind in signature.items()
                          if kind != "constexpr" and argument != "rows_total")
        assert_16_byte_stores(compile_for_hopper(kernel, signature, constexprs, divisible=divisible).asm["ptx"], name)

"""The W8A8 learner's per-token fp8 rounding as a Triton kernel (`learner.fp8_kernels`) against the
CPU reference (`learner.fp8_layers.quantize_per_token`), where Triton is installed: under Triton's
CPU interpreter, and lowered to sm_90 code. The GPU tier compares the kernel with vLLM's kernels
bit for bit (tests/integration/test_w8a8_gpu.py).

The interpreter's own conversion to fp8 is not the GPU's (it rounds ties away from zero and drops
the carry when a value rounds up to the next power of two: 126.9 becomes 64), so the codes are
compared with the reference's values before their conversion, converted by the interpreter too:
equal codes then mean equal values before the conversion, up to ties: the interpreter rounds a
value a hair off a tie as the tie, so `divide` and `reciprocal`, which part on ties, look alike
here and only the GPU test tells them apart. The scales are compared bit for bit."""

from __future__ import annotations

from triton_checks import NEEDS_TRITON, compile_for_hopper, run_under_interpreter

CHECK = r"""
import torch
import triton
import triton.language as tl
from learner.fp8_kernels import quantize_per_token_gpu
from learner.fp8_layers import quantize_per_token
from shared.formats import FP8_ROUNDINGS

generator = torch.Generator().manual_seed(0)
random = torch.randn(6, 5000, generator=generator) * torch.logspace(-3, 2, 6).reshape(-1, 1)  # two passes of 4,096
random[0] = 0.0  # the floor scale
random[1, 7] = 4.0e4  # one huge value
random = random.to(torch.bfloat16)
# every bf16 value up to an absolute max of 1568: the three roundings give 60 to 186 codes apart
# here (none below 1e-30, which the interpreter, not the GPU, flushes to zero on the way)
finite = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
finite = finite[finite.isfinite() & (finite.abs() <= 1568.0) & ((finite.abs() >= 1e-30) | (finite == 0))]
every_value = torch.cat([torch.tensor([1568.0]), finite]).to(torch.bfloat16).reshape(1, -1)


@triton.jit
def to_fp8(values_ptr, codes_ptr, count, block: tl.constexpr):
    offsets = tl.program_id(0) * block + tl.arange(0, block)
    values = tl.load(values_ptr + offsets, mask=offsets < count)
    tl.store(codes_ptr + offsets, values.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=offsets < count)


def interpreter_codes(values):
    codes = torch.empty(values.shape, dtype=torch.float8_e4m3fn)
    to_fp8[(triton.cdiv(values.numel(), 1024),)](values.contiguous(), codes, values.numel(), 1024)
    return codes


failures = []
for rounding in FP8_ROUNDINGS:
    for name, x in (("random", random), ("every bf16 value", every_value)):
        want_codes, want_scale = quantize_per_token(x, rounding)
        codes, scale = quantize_per_token_gpu(x, rounding)
        if codes.dtype != torch.float8_e4m3fn or scale.shape != want_scale.shape:
            failures.append(f"{rounding}, {name}: {codes.dtype} {tuple(scale.shape)}")
        if not torch.equal(scale.view(torch.int32), want_scale.view(torch.int32)):
            failures.append(f"{rounding}, {name}: scales {scale.flatten().tolist()} vs {want_scale.flatten().tolist()}")
        # the reference's values before the conversion (learner.fp8_layers.quantize_per_token)
        x32 = x.float()
        scaled = x32 / want_scale if rounding == "divide" else x32 * want_scale.reciprocal()
        want = interpreter_codes(scaled.clamp(-448.0, 448.0))
        off = (codes.view(torch.uint8) != want.view(torch.uint8)).sum().item()
        if off:
            failures.append(f"{rounding}, {name}: {off} of {codes.numel()} codes off")

# the weight for the input gradient: codes x per-row scale, as fp8_linear_input_grad's CPU branches
from learner.fp8_kernels import fp8_weight_gpu

bits = torch.randint(0, 256, (20, 300), generator=generator, dtype=torch.int32).to(torch.uint8)
bits[(bits & 0x7F) == 0x7F] = 0x3C  # e4m3fn's NaN codes hold no weight
qweight = bits.view(torch.float8_e4m3fn)
for scale_dtype in (torch.float16, torch.float32):
    scale = (torch.rand(20, 1, generator=generator) * 0.01 + 1e-4).to(scale_dtype)
    for dtype in (torch.float16, torch.float32):
        if scale.dtype == dtype:
            want = qweight.to(dtype) * scale
        else:
            want = (qweight.float() * scale.float()).to(dtype)
        got = fp8_weight_gpu(qweight, scale, dtype)
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            failures.append(f"fp8 weight, {scale_dtype} scales -> {dtype}")
assert not failures, failures
print("ok")
"""


@NEEDS_TRITON
def test_w8a8_kernels_match_the_reference_under_the_interpreter():
    run_under_interpreter(CHECK)


@NEEDS_TRITON
def test_w8a8_kernels_compile_for_hopper_without_a_gpu():
    import triton.language as tl

    from learner import fp8_kernels
    from learner.fp8_layers import FP8_MAX, MIN_SCALE
    from shared.formats import FP8_ROUNDINGS

    for mode in range(len(FP8_ROUNDINGS)):
        compile_for_hopper(fp8_kernels._per_token_fp8_kernel,
                           {"x_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "width": "i32",
                            **dict.fromkeys(("mode", "fp8_max", "min_scale", "block"), "constexpr")},
                           {"mode": mode, "fp8_max": FP8_MAX, "min_scale": MIN_SCALE, "block": fp8_kernels.BLOCK})
    compile_for_hopper(fp8_kernels._fp8_weight_kernel,
                       {"codes_ptr": "*u8", "scale_ptr": "*bf16", "out_ptr": "*bf16", "rows_total": "i32",
                        "width": "i32",
                        **dict.fromkeys(("out_dtype", "block_rows", "block_cols", "wide"), "constexpr")},
                       {"out_dtype": tl.bfloat16, "block_rows": 8, "block_cols": 256, "wide": False})

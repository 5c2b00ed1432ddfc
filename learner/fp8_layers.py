"""The learner holding exactly the engine's W8A8 FP8 weights and computing what its kernel computes.

A compressed-tensors FP8_DYNAMIC folder (`float-quantized`) holds each linear layer's weight as
float8_e4m3fn codes with one scale per output channel; vLLM serves it with
`CompressedTensorsW8A8Fp8`, which quantizes every activation entering the layer per token to
fp8 on the fly, multiplies fp8 by fp8 on the tensor cores (fp32 accumulation) and applies both
scales in fp32 (CUTLASS `cutlass_scaled_mm` on an H200). `Fp8Linear` holds the same codes and
scales and does the same: `quantize_per_token` rounds the input as vLLM's CUDA kernel does
(`dynamic_per_token_scaled_fp8_quant`: scale = max(amax / 448, 1 / (448 * 512)), x / scale
clamped to +-448, rounded to nearest even), then the product of the exact fp8 values is taken in
fp32 and scaled. Both sides compute the same function up to accumulation order.

Backward is straight-through: the rounding's gradient is taken as the identity, so
dX = dY W with W the dequantized weight (rebuilt in backward, never saved). peft's LoRA sits on
top through the packed layers' custom-module hook, and sees the unrounded input, as vLLM's LoRA
layers do (they add LoRA to the quantized base's output, computed from the same bf16 x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.formats import FP8_ROUNDINGS

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max, vLLM's quant_type_max_v
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's min_scaling_factor<fp8>: a zero row gets this scale


def quantize_per_token(x: torch.Tensor, rounding: str = "divide") -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes of `x` and their fp32 scales [..., 1], one per token (row), as the engine's
    `rounding` (FP8_ROUNDINGS) computes them: the absolute max in fp32, a scale floored at
    1/(448*512), each value divided by it or multiplied by its reciprocal, clamped to +-448 and
    rounded to nearest even (the saturating conversion). The modes round a few bf16 inputs apart
    (docs/formats.md)."""
    if rounding not in FP8_ROUNDINGS:
        raise ValueError(f"unknown fp8 activation rounding {rounding!r}")
    if x.is_cuda:  # the same arithmetic as one Triton kernel (about ten eager kernels otherwise)
        from learner.fp8_kernels import quantize_per_token_gpu

        return quantize_per_token_gpu(x, rounding)
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    if rounding == "by_constant":
        scale = amax * (1.0 / FP8_MAX)  # a Python number: multiplied as fl32(1/448) on every device
    else:
        # a tensor divisor: on a GPU torch turns division by a Python number into a product with
        # its fp32 reciprocal, which is not the kernel's division
        scale = amax / amax.new_full((1,), FP8_MAX)
    scale = torch.clamp(scale, min=MIN_SCALE)
    scaled = x32 / scale if rounding == "divide" else x32 * scale.reciprocal()
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fake_quantize_per_token(x: torch.Tensor, rounding: str = "divide") -> torch.Tensor:
    """x rounded per token to fp8 and scaled back, in fp32 (what the engine's GEMM sees)."""
    codes, scale = quantize_per_token(x, rounding)
    return codes.float() * scale


def fp8_weight(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes x per-channel scale, in fp32 (compressed-tensors' decompression, before its cast)."""
    return qweight.float() * scale.float()


def scaled_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                  rounding: str = "divide") -> torch.Tensor:
    """x (rounded per token) @ W.T + bias, in x's dtype, as the engine's kernel: exact fp8
    values multiplied and accumulated in fp32, both scales and the bias applied in fp32, one
    rounding at the end. On a GPU in bf16 this is torch's row-wise scaled fp8 GEMM (the FP8
    tensor cores, as CUTLASS on the engine); elsewhere the same arithmetic in fp32."""
    codes, x_scale = quantize_per_token(x, rounding)
    return fp8_matmul(codes, x_scale, qweight, scale, bias, x.dtype)


FAST_ACCUMULATION = True
"""Accumulate in the FP8 tensor cores' own precision, without promoting partial sums to fp32 every
few k-steps: vLLM's CUTLASS kernels for Hopper use the FP8FastAccum schedules, so the learner's
product is closer to the engine's this way (tests/integration/test_w8a8_gpu.py measures both)."""


def fp8_matmul(codes: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype,
               fast_accumulation: bool = FAST_ACCUMULATION) -> torch.Tensor:
    """The GEMM half of `scaled_matmul`, on codes already rounded (vLLM's cutlass_scaled_mm)."""
    if _fp8_tensor_cores(codes, qweight, out_dtype):
        rows = codes.reshape(-1, codes.shape[-1])
        out = torch._scaled_mm(rows, qweight.t(), scale_a=x_scale.reshape(-1, 1),
                               scale_b=scale.float().reshape(1, -1), bias=None if bias is None else bias.to(out_dtype),
                               out_dtype=out_dtype, use_fast_accum=fast_accumulation)
        return out.reshape(*codes.shape[:-1], -1)
    out = F.linear(codes.float(), qweight.float()) * x_scale * scale.float().reshape(1, -1)
    return (out if bias is None else out + bias.float()).to(out_dtype)


def _fp8_tensor_cores(codes: torch.Tensor, qweight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """torch's row-wise scaled GEMM: CUDA, sm_89+, bf16 out, both dimensions multiples of 16."""
    return (codes.is_cuda and out_dtype == torch.bfloat16 and torch.cuda.get_device_capability(codes.device) >= (8, 9)
            and qweight.shape[0] % 16 == 0 and qweight.shape[1] % 16 == 0)


# The engine's fp8 x fp8 product in forward, straight-through in backward (dX = dY W), as custom
# ops: a compiled decoder layer (learner.compile_layers) traces through them without a graph break
# (the 7 fp8 layers of a decoder layer otherwise cut it into 8 graphs, each with its own guards and
# wrappers on the host) and cannot see inside, so the per-token rounding stays the arithmetic
# written above (Inductor would rewrite its divisions, as it does in the engine). Only the fp8
# codes and scales are saved for backward; nothing dense.
@torch.library.custom_op("qerl::fp8_linear", mutates_args=())
def fp8_linear_op(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  rounding: str) -> torch.Tensor:
    return scaled_matmul(x, qweight, scale, bias, rounding)


@fp8_linear_op.register_fake
def _(x, qweight, scale, bias, rounding):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


@torch.library.custom_op("qerl::fp8_linear_input_grad", mutates_args=())
def fp8_linear_input_grad(grad_output: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dX = dY W, W the dequantized weight in dY's dtype."""
    if grad_output.is_cuda:  # the same product and rounding as below, one kernel
        from learner.fp8_kernels import fp8_weight_gpu

        weight = fp8_weight_gpu(qweight, scale, grad_output.dtype)
    elif scale.dtype == grad_output.dtype:  # fp8 x 16-bit scale is exact in fp32: one rounding either way
        weight = qweight.to(grad_output.dtype) * scale
    else:
        weight = fp8_weight(qweight, scale).to(grad_output.dtype)
    return grad_output @ weight


@fp8_linear_input_grad.register_fake
def _(grad_output, qweight, scale):
    return grad_output.new_empty(*grad_output.shape[:-1], qweight.shape[1])


def _save_fp8(ctx, inputs, output) -> None:
    _, qweight, scale, _, _ = inputs
    ctx.save_for_backward(qweight, scale)


def _fp8_linear_backward(ctx, grad_output):
    qweight, scale = ctx.saved_tensors
    return fp8_linear_input_grad(grad_output, qweight, scale), None, None, None, None


fp8_linear_op.register_autograd(_fp8_linear_backward, setup_context=_save_fp8)


def set_activation_rounding(model: nn.Module, rounding: str) -> None:
    """Round every Fp8Linear's input as the engines do (FP8_ROUNDINGS,
    shared.formats.fp8_activation_rounding); other layers are left alone."""
    if rounding not in FP8_ROUNDINGS:
        raise ValueError(f"unknown fp8 activation rounding {rounding!r}")
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.rounding = rounding


class Fp8Linear(nn.Module):
    """W8A8 FP8 linear layer: fp8-e4m3 weights with per-output-channel scales, inputs rounded per
    token to fp8 in forward (compressed-tensors FP8_DYNAMIC, vLLM's CompressedTensorsW8A8Fp8)."""

    folder_tensors = {"qweight": "weight", "scale": "weight_scale"}
    """Buffer -> the tensor's suffix in a compressed-tensors folder."""
    rounding = "divide"
    """How inputs are rounded (FP8_ROUNDINGS): as the engines that sample for this learner do."""

    def __init__(self, in_features: int, out_features: int, scale_dtype: torch.dtype = torch.float32,
                 bias: bool = False, device: str | torch.device = "cpu"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # named qweight: peft's LoRA hook looks the base layer's device up under that name
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("scale", torch.ones(out_features, 1, dtype=scale_dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    def dequantized_weight(self) -> torch.Tensor:
        return fp8_weight(self.qweight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self)


def fp8_linear(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    # the bias is added in fp32 inside, as the engine's epilogue does
    return fp8_linear_op(x, layer.qweight, layer.scale, layer.bias, layer.rounding)

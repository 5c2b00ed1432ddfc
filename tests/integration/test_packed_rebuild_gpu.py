"""The Triton rebuild of packed 4-bit weights (learner.packed_kernels) is bit-identical to the CPU
reference (the one compressed-tensors' decompression is checked against in test_quantized_base),
on every weight shape of the 7B model, for each scale dtype and each dtype the learner computes
in, so the exact pairs stay exact on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from learner.packed_layers import Int4Linear, Nvfp4Linear

SHAPES_7B = [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)]  # (out, in)


def _random_int4(out_features: int, in_features: int, scale_dtype: torch.dtype) -> Int4Linear:
    generator = torch.Generator().manual_seed(out_features + in_features)
    layer = Int4Linear(in_features, out_features, 128, scale_dtype)
    layer.qweight.copy_(torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, generator=generator, dtype=torch.int64)
                        .to(torch.int32))
    layer.scale.copy_(torch.rand(layer.scale.shape, generator=generator) * 0.02 + 1e-4)
    return layer


def _random_nvfp4(out_features: int, in_features: int) -> Nvfp4Linear:
    generator = torch.Generator().manual_seed(out_features * 3 + in_features)
    layer = Nvfp4Linear(in_features, out_features)
    layer.qweight.copy_(torch.randint(0, 256, layer.qweight.shape, generator=generator, dtype=torch.int32)
                        .to(torch.uint8))
    layer.scale.copy_((torch.rand(layer.scale.shape, generator=generator) * 400 + 1).to(torch.float8_e4m3fn))
    layer.global_scale.fill_(1234.5)
    return layer


@pytest.mark.gpu
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES_7B)
def test_int4_gpu_rebuild_is_bit_identical_to_the_cpu_reference(shape, scale_dtype):
    layer = _random_int4(*shape, scale_dtype)
    on_gpu = copy.deepcopy(layer).to("cuda")  # Module.to moves in place
    for dtype in (None, torch.bfloat16, torch.float16, torch.float32):  # None: the scales' dtype
        reference = layer.dequantized_weight(dtype)
        rebuilt = on_gpu.dequantized_weight(dtype).cpu()
        assert rebuilt.dtype == reference.dtype
        assert torch.equal(rebuilt.view(torch.uint8), reference.view(torch.uint8)), dtype


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES_7B)
def test_nvfp4_gpu_rebuild_is_bit_identical_to_the_cpu_reference(shape):
    layer = _random_nvfp4(*shape)
    reference = layer.dequantized_weight()
    on_gpu = layer.to("cuda")
    assert torch.equal(on_gpu.dequantized_weight().cpu().view(torch.int32), reference.view(torch.int32))
    # the learner's matmuls take the weight in their dtype, rounded inside the kernel: one rounding
    # of the same fp32 product, as casting the reference
    for dtype in (torch.bfloat16, torch.float16):
        rebuilt = on_gpu.dequantized_weight(dtype).cpu()
        assert torch.equal(rebuilt.view(torch.int16), reference.to(dtype).view(torch.int16)), dtype

"""The W8A8 FP8 pair on a GPU (vLLM 0.26, `pytest -m gpu`): the learner's per-token fp8 rounding
is bit-identical to vLLM's CUDA kernel, its fp8 GEMM (torch's row-wise scaled GEMM) agrees with
vLLM's CUTLASS one up to accumulation order, and an engine serving the learner's own folder with
LoRA samples the learner's policy, eager (the CUDA kernel) and compiled (forward_native).

That last check is not issue 26's "KL within 2x of the bf16 pair's": a one-ulp 16-bit difference
upstream of the base layers (the engine's FlashAttention against the learner's SDPA) moves a
W8A8 learner 7-8x as far as a bf16 one (`qerl bench sensitivity`), and the engine-vs-learner KL
measured 8.7x the bf16 pair's on an H100 (2026-12-06, 14k tokens). So the bound is 2x what that
amplification alone gives, measured in the same test; a lossy pair (9e-3 and more) stays far out.
"""

from __future__ import annotations

import pytest
import torch

from learner.fp8_layers import (
    FAST_ACCUMULATION,
    FP8_MAX,
    MIN_SCALE,
    Fp8Linear,
    fp8_matmul,
    quantize_per_token,
    scaled_matmul,
)

pytestmark = pytest.mark.gpu

SHAPES_7B = [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)]  # (out, in)


def _activations(tokens: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=generator) * torch.logspace(-2, 1, tokens).reshape(-1, 1)
    x[0] = 0.0  # a zero row: the minimum scale
    x[1, 3] = 4.0e4  # one huge value: the rest of the row near e4m3's subnormals
    return x.to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_per_token_rounding_is_vllms_cuda_kernel_bit_for_bit(tokens, dtype):
    """An eager engine's rounding (vLLM's CUDA kernel) against the learner's "divide". Its scale
    is a true division by 448; torch divides a GPU tensor by a Python number as a product with the
    number's fp32 reciprocal, which missed the kernel's scale in up to 157 of 256 rows (H100,
    2026-12-05: the learner's divisor is a tensor since)."""
    from vllm import _custom_ops as ops

    x = _activations(max(tokens, 2), 3584, dtype, seed=tokens)
    codes, scale = ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True)
    ours, our_scale = quantize_per_token(x, "divide")
    x32 = x.float()
    report = dict(
        scales_off=(scale.reshape(-1) != our_scale.reshape(-1)).sum().item(), codes_off=_codes_off(codes, ours),
        codes_off_reciprocal=_codes_off(codes, quantize_per_token(x, "reciprocal")[0]),
        scales_off_by_constant=(scale.reshape(-1) != _scale_by_constant(x32).reshape(-1)).sum().item(),
        scale_ulps=_ulp_counts(scale.reshape(-1), our_scale.reshape(-1)), numel=x.numel())
    print(report)
    assert report["scales_off"] == 0 and report["codes_off"] == 0, report


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES_7B)
def test_backward_weight_kernel_is_the_cpu_product_bit_for_bit(shape, scale_dtype):
    """The W8A8 backward's dense weight (learner.fp8_kernels.fp8_weight_gpu) against the CPU's:
    fp8 codes x row scales rounded once to the gradient's dtype."""
    from learner.fp8_kernels import fp8_weight_gpu

    generator = torch.Generator().manual_seed(shape[0] + shape[1])
    bits = torch.randint(0, 256, shape, generator=generator, dtype=torch.int32).to(torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    qweight = bits.view(torch.float8_e4m3fn)
    scale = (torch.rand(shape[0], 1, generator=generator) * 0.01 + 1e-4).to(scale_dtype)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = qweight.to(dtype) * scale if scale.dtype == dtype else (qweight.float() * scale.float()).to(dtype)
        got = fp8_weight_gpu(qweight.cuda(), scale.cuda(), dtype).cpu()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dtype


@pytest.mark.parametrize("emulate_division", [False, True])
def test_compiled_quant_fp8_on_a_gpu_is_the_learners_by_constant_rounding(emulate_division, monkeypatch):
    """What a compiled engine (enforce_eager off) runs: QuantFP8.forward_native under Inductor.
    Inductor turns the division by 448 into a product with fl32(1/448) off the CPU, and
    reciprocal() into Triton's approximate division unless TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING
    asks for div_rn (docs/formats.md). With it (qerl's compiled w8a8 workers set it), the learner's
    "by_constant" rounding is the engine's bit for bit; without it the scales still are."""
    import torch._inductor.config as inductor_config
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    numerics = getattr(inductor_config, "eager_numerics", None)
    if emulate_division:
        if numerics is None or not hasattr(numerics, "division_rounding"):
            pytest.skip(f"torch {torch.__version__}'s Inductor has no eager_numerics.division_rounding")
        monkeypatch.setattr(numerics, "division_rounding", True)
    torch._dynamo.reset()
    x = _activations(256, 3584, torch.bfloat16, seed=11)
    with set_current_vllm_config(VllmConfig()):
        quant = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
        codes, scale = torch.compile(quant.forward_native, fullgraph=True, dynamic=False)(x)
    report = {"torch": torch.__version__, "numel": x.numel()}
    for rounding in ("by_constant", "reciprocal", "divide"):
        ours, our_scale = quantize_per_token(x, rounding)
        report[f"scales_off_{rounding}"] = (scale.reshape(-1) != our_scale.reshape(-1)).sum().item()
        report[f"codes_off_{rounding}"] = _codes_off(codes, ours)
    print(report)
    assert report["scales_off_by_constant"] == 0, report
    if emulate_division:
        assert report["codes_off_by_constant"] == 0, report


def _scale_by_constant(x32: torch.Tensor) -> torch.Tensor:
    """max(amax x fl32(1/448), min): the per-token scale with the division by 448 turned into a
    product with its rounded reciprocal (what fast math or Inductor's constant rewrite does)."""
    return torch.clamp(x32.abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX), min=MIN_SCALE)


def _codes_off(codes: torch.Tensor, ours: torch.Tensor) -> int:
    return (codes.view(torch.uint8) != ours.view(torch.uint8)).sum().item()


def _ulp_counts(theirs: torch.Tensor, ours: torch.Tensor) -> dict[int, int]:
    """How many rows' fp32 scales differ by each number of ulps (positive scales)."""
    steps = theirs.float().view(torch.int32).long() - ours.float().view(torch.int32).long()
    values, counts = steps.unique(return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))


def _random_layer(out_features: int, in_features: int) -> Fp8Linear:
    generator = torch.Generator().manual_seed(out_features + in_features)
    layer = Fp8Linear(in_features, out_features, torch.bfloat16)
    # clamped: e4m3fn has no infinity, a value past 448 casts to NaN
    codes = (torch.randn(out_features, in_features, generator=generator) * 100).clamp(-448, 448)
    layer.qweight.copy_(codes.to(torch.float8_e4m3fn))
    layer.scale.copy_(torch.rand(out_features, 1, generator=generator) * 1e-3 + 1e-4)
    return layer.cuda()


@pytest.mark.parametrize("shape", SHAPES_7B)
def test_the_learners_fp8_gemm_is_cutlass_up_to_accumulation_order(shape):
    from vllm import _custom_ops as ops

    layer = _random_layer(*shape)
    x = _activations(64, shape[1], torch.bfloat16, seed=shape[0])
    codes, x_scale = ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True)
    weight_scale = layer.scale.float().reshape(-1, 1)  # per output channel, as vLLM holds it
    engine = ops.cutlass_scaled_mm(codes, layer.qweight.t(), scale_a=x_scale, scale_b=weight_scale,
                                   out_dtype=torch.bfloat16)
    ours = scaled_matmul(x, layer.qweight, layer.scale)
    # the GEMM alone, on the engine's own codes and scales, with and without fast accumulation
    gemm = {fast: fp8_matmul(codes, x_scale, layer.qweight, layer.scale, None, torch.bfloat16, fast)
            for fast in (False, True)}
    reference = scaled_matmul(x.cpu(), layer.qweight.cpu(), layer.scale.cpu())  # fp32, one rounding
    tolerance = dict(rtol=2**-7, atol=1e-3 * engine.float().abs().max().item())
    facts = dict(engine_max=engine.float().abs().max().item(),
                 ours_vs_engine=(ours.float() - engine.float()).abs().max().item(),
                 ours_vs_reference=(ours.float().cpu() - reference.float()).abs().max().item(),
                 bit_equal=(ours == engine).float().mean().item(),
                 **{f"gemm_bit_equal_fast_accumulation_{fast}": (out == engine).float().mean().item()
                    for fast, out in gemm.items()})
    print(facts)
    assert torch.allclose(ours.float(), engine.float(), **tolerance), facts
    assert torch.allclose(ours.float().cpu(), reference.float(), **tolerance), facts
    # the same codes and scales through cuBLASLt and CUTLASS: the learner's setting is the one
    # that agrees with the engine more often (without fast accumulation 0.50-0.76 of the bf16
    # outputs were bit-equal on an H100, 2026-12-05)
    chosen, other = (facts[f"gemm_bit_equal_fast_accumulation_{fast}"] for fast in (FAST_ACCUMULATION,
                                                                                  not FAST_ACCUMULATION))
    assert chosen >= other, facts
    # the whole path, rounding included: as bit-equal as the GEMM alone (the rounding is the kernel's)
    assert facts["bit_equal"] == pytest.approx(chosen, abs=0.02), facts


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_a_w8a8_engine_with_lora_samples_the_learners_policy(tiny_model, enforce_eager):
    from benchmarks.fidelity import FidelityBenchArgs, bench_fidelity
    from shared.config import load_config

    config = load_config("configs/bench_gpu.yaml", [
        f"rollout.enforce_eager={str(enforce_eager).lower()}", "rollout.gpu_memory_utilization=0.3",
        "rollout.kv_cache_memory_bytes=1073741824", "lora.rank=8", "lora.alpha=16", "rollout.samples_per_prompt=4",
    ])
    report = bench_fidelity(config, FidelityBenchArgs(formats=("bf16", "w8a8"), prompts=256))
    rows = {row["format"]: row for row in report["rows"]}
    w8a8, bf16 = rows["w8a8"], rows["bf16"]
    assert w8a8["exact"] and w8a8["engine_dtype"] == "bfloat16" and w8a8["tokens"] > 5000
    amplification = _one_ulp_amplification(config)
    print(f"w8a8 KL {w8a8['kl_mean']:.2e} = {w8a8['kl_mean'] / bf16['kl_mean']:.1f}x bf16's; "
          f"a one-ulp difference alone: {amplification:.1f}x")  # validate.sh keeps it
    assert w8a8["kl_mean"] <= 2 * amplification * bf16["kl_mean"], (w8a8, bf16, amplification)


def _one_ulp_amplification(config) -> float:
    """W8A8's KL over bf16's when only the attention kernel differs (qerl bench sensitivity)."""
    from benchmarks.sensitivity import SensitivityBenchArgs, bench_sensitivity

    report = bench_sensitivity(config, SensitivityBenchArgs(formats=("bf16", "w8a8")))
    return next(r["kl_vs_bf16"] for r in report["rows"] if r["format"] == "w8a8" and r["perturbation"] == "attention")

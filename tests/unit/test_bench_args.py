"""The benchmarks' argument checks and pure helpers: what each refuses before any engine or
learner starts, the default sequence lengths, and the profile's busy-time union."""

from __future__ import annotations

import pytest

from benchmarks.fleet import FleetBenchArgs, bench_fleet
from benchmarks.learner import LearnerBenchArgs, bench_learner
from benchmarks.profile import busy_us, kernel_kind
from benchmarks.rollout import sequence_lengths
from shared.config import load_config
from shared.errors import QerlError


def test_default_lengths_fit_the_model_and_too_long_is_an_error():
    assert sequence_lengths(None, None, 32768) == (256, 512)
    assert sequence_lengths(None, None, 256) == (64, 128)  # the tiny model's context
    with pytest.raises(QerlError, match="exceed the model's context of 256 tokens"):
        sequence_lengths(256, 512, 256)


def test_bench_learner_rejects_an_unknown_format():
    with pytest.raises(QerlError, match="--formats int3"):
        bench_learner(load_config(None), LearnerBenchArgs(formats=("int3",)))


def test_busy_time_is_the_union_of_kernel_intervals():
    intervals = [("a", 0.0, 10.0), ("b", 5.0, 12.0), ("c", 20.0, 25.0), ("d", 21.0, 22.0)]
    assert busy_us(intervals) == 17.0
    assert kernel_kind("_lora_shrink_kernel") == "lora"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_kind("flash_fwd_splitkv_kernel") == "attention"
    # inductor names the learner's fused int4 rebuild after its ops
    assert kernel_kind("triton_poi_fused___rshift____to_copy_arange_bitwise_and_clone_expand_mul_sub_0") \
        == "4-bit rebuild"
    assert kernel_kind("_nvfp4_rebuild_kernel") == "4-bit rebuild"  # learner.packed_kernels
    # Inductor's kernels are named after what they fuse and feed, never a GEMM: a W8A8 engine's
    # norm + fp8 rounding, a compiled RMSNorm (named after its ops), and the rest
    assert kernel_kind("triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_fused_add_rms_norm_0") \
        == "fp8 quantization"
    assert kernel_kind("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1") == "norm/activation"
    assert kernel_kind("triton_poi_fused_mul_silu_slice_1") == "norm/activation"
    assert kernel_kind("triton_poi_fused_4") == "fused elementwise"
    assert kernel_kind("void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8>") == "gemm"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor>") == "copy/fill"


def test_bench_fleet_bad_sweeps():
    config = load_config(None, [])
    with pytest.raises(QerlError, match="--dispatch takes queue and/or slices"):
        bench_fleet(config, FleetBenchArgs(dispatch=("round-robin",)))
    with pytest.raises(QerlError, match="--slow-worker is a slowdown factor"):
        bench_fleet(config, FleetBenchArgs(slow_worker=0.5))


def test_bench_rebuild_refuses_other_formats_and_a_machine_without_a_gpu():
    import torch

    from benchmarks.rebuild import RebuildBenchArgs, bench_rebuild, weight_shapes
    from benchmarks.shapes import shape_folder

    config = load_config(None, [])
    with pytest.raises(QerlError, match="--formats w8a8: qerl bench rebuild measures int4, nvfp4"):
        bench_rebuild(config, RebuildBenchArgs(formats=("w8a8",)))
    if not torch.cuda.is_available():
        with pytest.raises(QerlError, match="needs a CUDA GPU"):
            bench_rebuild(config, RebuildBenchArgs())
    # the 7B layers a micro-batch rebuilds: q/o, k/v, gate/up, down
    assert weight_shapes(shape_folder("qwen2.5-7b")) == {(3584, 3584): 56, (512, 3584): 56, (18944, 3584): 56,
                                                         (3584, 18944): 28}

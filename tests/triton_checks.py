"""What the Triton kernel tests share (learner.packed_kernels, fp8_kernels, vocab_kernels): the
skip where Triton is not installed (CI's CPU venv), a check script run under Triton's CPU
interpreter, and a kernel lowered to sm_90 code with Triton's bundled compiler, no GPU needed."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (the GPU tier runs the kernels)")

ROOT = Path(__file__).resolve().parents[1]


def run_under_interpreter(script: str) -> None:
    """Run `script` with TRITON_INTERPRET=1 in a fresh interpreter (the flag is read at import);
    it prints "ok" when its checks pass."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def compile_for_hopper(kernel, signature: dict[str, str], constexprs: dict, num_warps: int = 4,
                       divisible: tuple[str, ...] = ()):
    """`kernel` lowered to sm_90 (its cubin and PTX in `.asm`); `divisible` names the arguments the
    JIT would see as multiples of 16 (pointers and the sizes of Qwen2.5's shapes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(signature) if name in divisible}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert compiled.asm["cubin"], kernel
    return compiled


def assert_16_byte_stores(ptx: str, name: str) -> None:
    """Every global store in `ptx` is a 16-byte vector (`st.global.v4.*`): the kernel writes its
    output at full width (NVFP4's first tiled kernel stored 4 bytes at a time and ran at a quarter
    of the memory floor on an H100)."""
    stores = re.findall(r"\bst\.global\.([\w.]+)", ptx)
    assert stores and all(kind.startswith("v4.") for kind in stores), (name, stores)

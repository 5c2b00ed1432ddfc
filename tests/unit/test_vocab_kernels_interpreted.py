"""The learner's Triton kernels over the vocabulary (`learner.vocab_kernels`: log-normaliser,
chosen logprob and entropy in one online pass; the logits' gradient) against the eager reference
in `learner.logprobs`, where Triton is installed: under Triton's CPU interpreter, and lowered to
sm_90 code. The GPU tier compares them with fp32 autograd on a 152k vocabulary
(tests/integration/test_learner_gpu.py)."""

from __future__ import annotations

from triton_checks import NEEDS_TRITON, assert_16_byte_stores, compile_for_hopper, run_under_interpreter

CHECK = r"""
import torch
from learner.logprobs import _logits_gradient, _vocabulary_scores
from learner.vocab_kernels import BLOCK, logits_gradient_gpu, vocabulary_scores_gpu

generator = torch.Generator().manual_seed(0)
failures = []
# one partial block; several blocks with the largest logit in a later one (the online rescale);
# a cut last block
for tokens, vocab in ((5, 1000), (3, 2 * BLOCK + 808)):
    for dtype in (torch.float32, torch.float16):
        for temperature in (1.0, 0.7):
            logits = torch.randn(tokens, vocab, generator=generator) * 4
            logits[:, -5] += 30.0
            logits = logits.to(dtype)
            targets = torch.randint(0, vocab, (tokens,), generator=generator)
            targets[0] = vocab - 5
            want = _vocabulary_scores(logits, targets, temperature)
            got = vocabulary_scores_gpu(logits, targets, temperature)
            # entropy = normaliser - sum(p x) cancels: a few ulps of the normaliser (about 40 here)
            for name, a, b, atol in zip(("chosen", "normaliser", "entropy"), got, want, (2e-5, 2e-5, 2e-4)):
                if a.dtype != torch.float32 or not torch.allclose(a, b, atol=atol, rtol=1e-5):
                    failures.append(f"{name} {tokens}x{vocab} {dtype} T={temperature}: {(a - b).abs().max()}")
            grad = torch.randn(tokens, generator=generator)
            want_grad = _logits_gradient(logits, targets, want[1], grad, temperature)
            got_grad = logits_gradient_gpu(logits, targets, want[1], grad, temperature)
            if got_grad.dtype != dtype or not torch.allclose(got_grad.float(), want_grad.float(), atol=1e-6, rtol=2e-3):
                failures.append(f"gradient {tokens}x{vocab} {dtype} T={temperature}")
assert not failures, failures
print("ok")
"""


@NEEDS_TRITON
def test_vocabulary_kernels_match_the_reference_under_the_interpreter():
    run_under_interpreter(CHECK)


@NEEDS_TRITON
def test_vocabulary_kernels_compile_for_hopper_without_a_gpu():
    """Lowered as the JIT compiles them for a 152k vocabulary of bf16 logits: each thread loads the
    logits 16 bytes at a time, and the gradient is stored so."""
    import triton.language as tl

    from learner import vocab_kernels

    sizes = {"vocab": "i32", "inverse_temperature": "fp32"}
    scores = {"logits_ptr": "*bf16", "targets_ptr": "*i64", "chosen_ptr": "*fp32", "normaliser_ptr": "*fp32",
              "entropy_ptr": "*fp32", **sizes, "block": "constexpr"}
    gradient = {"logits_ptr": "*bf16", "targets_ptr": "*i64", "normaliser_ptr": "*fp32", "grad_ptr": "*fp32",
                "out_ptr": "*bf16", **sizes, "out_dtype": "constexpr", "block": "constexpr"}
    for kernel, signature, constexprs, vector_stores in (
            (vocab_kernels._vocabulary_scores_kernel, scores, {"block": vocab_kernels.BLOCK}, False),
            (vocab_kernels._logits_gradient_kernel, gradient, {"block": vocab_kernels.BLOCK, "out_dtype": tl.bfloat16},
             True)):
        divisible = tuple(name for name, kind in signature.items() if kind.startswith("*") or name == "vocab")
        ptx = compile_for_hopper(kernel, signature, constexprs, num_warps=vocab_kernels.NUM_WARPS,
                                 divisible=divisible).asm["ptx"]
        assert "ld.global.v4.b32" in ptx, kernel
        if vector_stores:
            assert_16_byte_stores(ptx, kernel.__name__)

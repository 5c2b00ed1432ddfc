"""The learner's work over the vocabulary on a GPU: two Triton kernels, launched directly.

`learner.logprobs` projects a chunk of completion positions onto the vocabulary and needs, per
position, the log-normaliser, the chosen token's logprob and the entropy (forward), then the
logits' gradient (backward). `torch.compile` of the eager reference fused each side into one
kernel, but the forward one ran at about 4 % of the memory floor on an H100 (4.7 ms for 2,048 x
152k bf16 logits, which one read takes 0.2 ms: BENCHMARKS.md, H100 2026-12-07, midday, the bf16
learner profile) and the backward at about 30 %. Here the forward reads each row once: an online
log-sum-exp that also carries the sum of p x, so max, normaliser and entropy come from one pass.

The arithmetic is the reference's up to fp32 summation order: logits in fp32 times fp32(1 / T)
(eager PyTorch on a GPU divides by a Python number so), the chosen logit minus the normaliser,
entropy = normaliser - sum(p x). The GPU test compares both kernels with fp32 autograd on a 152k
vocabulary; the unit test runs them under Triton's CPU interpreter against the eager reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from learner.packed_kernels import TRITON_DTYPES, _round_to

BLOCK = 4096  # vocabulary entries a program takes at once: 152,064 is 37 blocks
NUM_WARPS = 8  # 16 entries a thread: two 16-byte loads of bf16 logits


@triton.jit
def _vocabulary_scores_kernel(logits_ptr, targets_ptr, chosen_ptr, normaliser_ptr, entropy_ptr, vocab,
                              inverse_temperature, block: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * vocab
    peak = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)  # sum of exp(x - peak)
    weighted = tl.full((), 0.0, tl.float32)  # sum of exp(x - peak) * x
    for start in range(0, vocab, block):
        cols = start + tl.arange(0, block)
        inside = cols < vocab
        x = tl.load(logits_row + cols, mask=inside, other=float("-inf")).to(tl.float32) * inverse_temperature
        new_peak = tl.maximum(peak, tl.max(x, axis=0))
        rescale = tl.exp(peak - new_peak)
        e = tl.exp(x - new_peak)  # 0 outside the vocabulary, where x * e would be nan
        total = total * rescale + tl.sum(e, axis=0)
        weighted = weighted * rescale + tl.sum(tl.where(inside, e * x, 0.0), axis=0)
        peak = new_peak
    normaliser = peak + tl.log(total)
    target = tl.load(targets_ptr + row)
    chosen = tl.load(logits_row + target).to(tl.float32) * inverse_temperature
    tl.store(chosen_ptr + row, chosen - normaliser)
    tl.store(normaliser_ptr + row, normaliser)
    tl.store(entropy_ptr + row, normaliser - weighted / total)


@triton.jit
def _logits_gradient_kernel(logits_ptr, targets_ptr, normaliser_ptr, grad_ptr, out_ptr, vocab, inverse_temperature,
                            out_dtype: tl.constexpr, block: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * block + tl.arange(0, block)
    inside = cols < vocab
    x = tl.load(logits_ptr + row * vocab + cols, mask=inside, other=0.0).to(tl.float32) * inverse_temperature
    probs = tl.exp(x - tl.load(normaliser_ptr + row))
    onehot = (cols == tl.load(targets_ptr + row)).to(tl.float32)
    scale = tl.load(grad_ptr + row) * inverse_temperature
    tl.store(out_ptr + row * vocab + cols, _round_to((onehot - probs) * scale, out_dtype), mask=inside)


def _inverse(temperature: float) -> float:
    """fp32(1 / fp32(T)), as a Python float Triton passes unchanged as fp32."""
    return (torch.tensor(1.0) / torch.tensor(temperature, dtype=torch.float32)).item()


def vocabulary_scores_gpu(logits: torch.Tensor, targets: torch.Tensor,
                          temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`learner.logprobs._vocabulary_scores` on CUDA logits [tokens, vocab]: chosen logprob,
    log-normaliser and entropy, fp32 [tokens]."""
    logits, targets = logits.contiguous(), targets.contiguous()
    tokens, vocab = logits.shape
    chosen, normaliser, entropy = (torch.empty(tokens, dtype=torch.float32, device=logits.device) for _ in range(3))
    if tokens:
        _vocabulary_scores_kernel[(tokens,)](logits, targets, chosen, normaliser, entropy, vocab,
                                             _inverse(temperature), BLOCK, num_warps=NUM_WARPS)
    return chosen, normaliser, entropy


def logits_gradient_gpu(logits: torch.Tensor, targets: torch.Tensor, normaliser: torch.Tensor,
                        grad_chosen: torch.Tensor, temperature: float) -> torch.Tensor:
    """`learner.logprobs._logits_gradient` on CUDA: (onehot(target) - softmax(logits / T)) x g / T
    in the logits' dtype."""
    logits, targets = logits.contiguous(), targets.contiguous()
    tokens, vocab = logits.shape
    out = torch.empty_like(logits)
    if tokens:
        grid = (tokens, triton.cdiv(vocab, BLOCK))
        _logits_gradient_kernel[grid](logits, targets, normaliser.contiguous(), grad_chosen.float().contiguous(),
                                      out, vocab, _inverse(temperature), TRITON_DTYPES[logits.dtype], BLOCK,
                                      num_warps=NUM_WARPS)
    return out

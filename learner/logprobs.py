"""Per-token logprobs (and entropy) of completions under the learner's policy at temperature T.

Only completion positions reach the vocabulary projection, a chunk of tokens at a time: the
full-vocabulary fp32 logits of a micro-batch (16 x 266 tokens x 152k x 4 B = 2.6 GB on a 7B
model, plus as much again for their log-softmax) never exist at once, and prompt positions are
never projected. Under autograd only each chunk's hidden states and log-normalisers are kept: its
logits are recomputed in backward (one GEMM) and turned straight into their gradient. On a GPU
the work over the vocabulary (log-normaliser, chosen logprob and entropy in forward, the logits'
gradient in backward) runs as two Triton kernels (`learner.vocab_kernels`) that read the 16-bit
logits once, instead of a dozen eager fp32 passes over them (the 7B learner profile in
BENCHMARKS.md); the CPU runs the eager reference below.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOGIT_CHUNK_TOKENS = 2048
"""Completion tokens projected onto the vocabulary at once: 2048 x 152k fp32 logits = 1.2 GB."""


@dataclass
class TokenScores:
    logprobs: torch.Tensor  # [batch, max_completion_len]
    entropy: torch.Tensor  # [batch, max_completion_len], detached
    mask: torch.Tensor  # [batch, max_completion_len], 1.0 on real completion tokens


@dataclass
class _Rows:
    """A right-padded micro-batch and where its completion tokens sit."""

    input_ids: torch.Tensor  # [batch, width]
    attention: torch.Tensor  # [batch, width]
    rows: torch.Tensor  # [tokens]: the row of each completion token
    predictors: torch.Tensor  # [tokens]: the position whose output predicts it (one before it)
    columns: torch.Tensor  # [tokens]: its index within the completion
    targets: torch.Tensor  # [tokens]: the token itself
    longest: int


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` without waiting for the GPU: a plain copy from pageable host memory
    synchronizes the stream (the host would wait for the previous micro-batch's backward before
    queueing the next forward), one from pinned memory does not. Pinned blocks come from
    PyTorch's caching host allocator, which keeps them until the copy is done."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _rows(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> _Rows:
    lengths = [len(prompt) + len(completion) for prompt, completion in pairs]
    input_ids = torch.full((len(pairs), max(lengths)), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    rows, predictors, columns, targets = [], [], [], []
    for row, (prompt, completion) in enumerate(pairs):
        input_ids[row, : lengths[row]] = torch.tensor(prompt + completion)
        attention[row, : lengths[row]] = 1
        count = len(completion)
        rows += [row] * count
        predictors += range(len(prompt) - 1, len(prompt) - 1 + count)
        columns += range(count)
        targets += completion
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return _Rows(input_ids, attention, as_long(rows), as_long(predictors), as_long(columns), as_long(targets),
                 max(len(completion) for _, completion in pairs))


def _vocabulary_scores(logits: torch.Tensor, targets: torch.Tensor,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From a chunk's logits h W^T: log softmax(logits / T)[target], the log-normaliser and the
    entropy, all in fp32."""
    scaled = logits.float() / temperature
    normaliser = torch.logsumexp(scaled, dim=-1)
    chosen = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normaliser
    probs = torch.exp(scaled - normaliser.unsqueeze(-1))
    entropy = normaliser - (probs * scaled).sum(-1)
    return chosen, normaliser, entropy


def _logits_gradient(logits: torch.Tensor, targets: torch.Tensor, normaliser: torch.Tensor, grad_chosen: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """d(chosen)/d(logits) x the incoming gradient: (onehot(target) - softmax(logits / T)) x g / T,
    in the logits' dtype (what autograd of `_vocabulary_scores` gives, cast back for the GEMM)."""
    probs = torch.exp(logits.float() / temperature - normaliser.unsqueeze(-1))
    onehot = torch.zeros_like(probs).scatter_(-1, targets.unsqueeze(-1), 1.0)
    return ((onehot - probs) * (grad_chosen / temperature).unsqueeze(-1)).to(logits.dtype)


def _vocabulary_work(device: torch.device) -> tuple[Callable, Callable]:
    """(scores, logits' gradient) on `device`: the Triton kernels on CUDA, the eager reference above
    elsewhere (Triton is imported on CUDA only)."""
    if device.type != "cuda":
        return _vocabulary_scores, _logits_gradient
    from learner.vocab_kernels import logits_gradient_gpu, vocabulary_scores_gpu

    return vocabulary_scores_gpu, logits_gradient_gpu


class _ChunkScores(torch.autograd.Function):
    """(chosen logprob, entropy) of a chunk of positions; the entropy is reported, not trained."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden, weight, bias)
        scores, _ = _vocabulary_work(logits.device)
        chosen, normaliser, entropy = scores(logits, targets, temperature)
        ctx.save_for_backward(hidden, weight, bias, targets, normaliser)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx, grad_chosen: torch.Tensor, _grad_entropy: torch.Tensor):
        hidden, weight, bias, targets, normaliser = ctx.saved_tensors
        logits = F.linear(hidden, weight, bias)  # recomputed: never kept between the passes
        _, gradient = _vocabulary_work(logits.device)
        grad_logits = gradient(logits, targets, normaliser, grad_chosen, ctx.temperature)
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        grad_bias = grad_logits.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None


def lora_in_compute_dtype(head_weight: torch.Tensor):
    """Autocast to the base's 16-bit compute dtype (none on an fp32 base): a bare peft model
    keeps its LoRA weights in fp32 and would compute every LoRA product in fp32, casting each
    layer's input up and the result back (the bf16 7B learner profile in BENCHMARKS.md). A
    Learner's model already holds 16-bit copies (learner.lora_weights), on which this changes
    nothing. vLLM computes LoRA in the engine dtype too. Gradient checkpointing recomputes under
    the same autocast state."""
    dtype = head_weight.dtype
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(head_weight.device.type, dtype=dtype)


def completion_logprobs(
    model, pairs: list[tuple[list[int], list[int]]], temperature: float, pad_id: int
) -> TokenScores:
    """log softmax(logits / T) of each completion token given its prompt and earlier tokens.

    `model` is a causal LM (or a peft model around one); its decoder runs on the right-padded
    rows, then the completion positions' hidden states are projected chunk by chunk.
    """
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = causal.get_output_embeddings()
    device = head.weight.device
    batch = _rows(pairs, pad_id)
    with lora_in_compute_dtype(head.weight):
        # no KV cache: a training forward has no later step to serve, and a cache makes each
        # compiled decoder layer guard on its own cache entry (one graph per layer, not one)
        # rows of one length need no mask: transformers then skips its padding check, which waits for the GPU
        attention = None if bool(batch.attention.all()) else to_device(batch.attention, device)
        decoded = causal.get_decoder()(input_ids=to_device(batch.input_ids, device), attention_mask=attention,
                                       use_cache=False)
    hidden = decoded.last_hidden_state
    rows = to_device(batch.rows, device)
    picked = hidden[rows, to_device(batch.predictors, device)]  # [tokens, hidden]
    targets = to_device(batch.targets, device)
    chosen, entropy = [], []
    for first in range(0, picked.shape[0], LOGIT_CHUNK_TOKENS):
        args = (picked[first : first + LOGIT_CHUNK_TOKENS], head.weight, head.bias,
                targets[first : first + LOGIT_CHUNK_TOKENS], temperature)
        scores = _ChunkScores.apply(*args)
        chosen.append(scores[0])
        entropy.append(scores[1])
    shape = (len(pairs), batch.longest)
    where = (rows, to_device(batch.columns, device))
    logprobs = torch.zeros(shape, device=device).index_put(where, torch.cat(chosen))
    entropies = torch.zeros(shape, device=device).index_put(where, torch.cat(entropy))
    mask = torch.zeros(shape, device=device).index_put(where, torch.ones_like(targets, dtype=torch.float32))
    return TokenScores(logprobs=logprobs, entropy=entropies, mask=mask)

"""Micro-batch limits from the memory actually free (`learner.micro_batch_size: auto`,
`learner.gradient_checkpointing: auto`).

A 4-bit base leaves the learner GPU memory a bf16 base would take; spent on larger
micro-batches, or on keeping activations instead of recomputing them, it turns into speed. At
the first training step on a GPU the learner measures what a probe micro-batch of the step's
longest sequences costs per token, with checkpointing off and, if that does not leave room for
AUTO_MIN_TOKENS, on; the token budget follows from the free memory. Fixed settings skip this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner.logprobs import completion_logprobs
from shared.config import LearnerConfig

AUTO_ROWS_ON_CPU = 64
"""`micro_batch_size: auto` on a CPU, where nothing is measured: the default size."""
PROBE_TOKENS = 2048
"""Tokens of the probe micro-batch (at least one sequence)."""
AUTO_MIN_TOKENS = 2048
"""Checkpointing stays off only if a micro-batch of this many tokens fits without it: smaller
GEMMs lose more than the third of the FLOPs that recomputing costs."""
HEADROOM = 0.85
"""Share of the free memory the token budget may plan for (the allocator fragments, lengths vary)."""


@dataclass(frozen=True)
class MicroBatchLimits:
    rows: int | None
    """Sequences per micro-batch; None: only the token budget limits it."""
    tokens: int | None
    """Padded tokens (rows x longest row) per micro-batch; None: no budget."""
    gradient_checkpointing: bool


def fixed_limits(config: LearnerConfig) -> MicroBatchLimits | None:
    """The limits when nothing is left to measure; None when the first step must measure them."""
    automatic = config.micro_batch_size == "auto" or config.gradient_checkpointing == "auto"
    if automatic and torch.cuda.is_available():
        return None
    rows = AUTO_ROWS_ON_CPU if config.micro_batch_size == "auto" else config.micro_batch_size
    return MicroBatchLimits(rows, config.micro_batch_tokens, config.gradient_checkpointing is True)


def set_gradient_checkpointing(model, enabled: bool) -> None:
    """Recompute the base's activations in backward (or stop doing so)."""
    if enabled:
        # non-reentrant: works with frozen (even packed 4-bit) bases and needs no input grads
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif model.is_gradient_checkpointing:
        model.gradient_checkpointing_disable()


def cap_learner_memory(config: LearnerConfig) -> None:
    """learner.gpu_memory_gib: the allocator refuses more than that (a smaller card's share)."""
    if config.gpu_memory_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, config.gpu_memory_gib * 2**30 / total))


def available_bytes(config: LearnerConfig) -> int:
    """GPU memory this learner may still allocate: free on the device plus what its allocator
    holds unused, within learner.gpu_memory_gib."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    allocated = torch.cuda.memory_allocated()
    available = free + torch.cuda.memory_reserved() - allocated
    if config.gpu_memory_gib:
        available = min(available, int(config.gpu_memory_gib * 2**30) - allocated)
    return max(available, 0)


def choose_limits(learner, samples: list, temperature: float) -> MicroBatchLimits:
    """Measure, then fix, the micro-batch limits for this run (learner: learner.actor.Learner)."""
    config = learner.config
    lengths = sorted((len(s.prompt_ids) + len(s.completion_ids) for s in samples), reverse=True)
    rows = None if config.micro_batch_size == "auto" else config.micro_batch_size
    choices = [False, True] if config.gradient_checkpointing == "auto" else [config.gradient_checkpointing]
    for checkpointing in choices:
        set_gradient_checkpointing(learner.model, checkpointing)
        per_token = probe_bytes_per_token(learner, samples, temperature)
        budget = int(HEADROOM * available_bytes(config) / per_token) if per_token else None
        fits = budget is not None and budget >= max(AUTO_MIN_TOKENS if rows is None else rows * lengths[0], lengths[0])
        if fits or checkpointing is choices[-1]:
            tokens = budget if rows is None else config.micro_batch_tokens
            if config.micro_batch_tokens and tokens:
                tokens = min(tokens, config.micro_batch_tokens)
            return MicroBatchLimits(rows, max(tokens, lengths[0]) if tokens else None, checkpointing)
    raise AssertionError("unreachable: the last choice always returns")


def probe_bytes_per_token(learner, samples: list, temperature: float) -> float | None:
    """Peak memory per token of a forward and backward over the longest samples (None: out of
    memory, i.e. not even the probe fits)."""
    longest = sorted(samples, key=lambda s: -(len(s.prompt_ids) + len(s.completion_ids)))
    probe, tokens = [], 0
    for sample in longest:
        probe.append(sample)
        tokens = len(probe) * (len(longest[0].prompt_ids) + len(longest[0].completion_ids))
        if tokens >= PROBE_TOKENS:
            break
    learner.lora.zero_grad()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        pairs = [(s.prompt_ids, s.completion_ids) for s in probe]
        completion_logprobs(learner.model, pairs, temperature, learner.pad_id).logprobs.sum().backward()
        peak = torch.cuda.max_memory_allocated()
    except torch.cuda.OutOfMemoryError:
        peak = None
    learner.lora.zero_grad()
    torch.cuda.empty_cache()
    return None if peak is None else (peak - before) / tokens

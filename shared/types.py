"""Wire types between the driver, the rollout workers and the learner (plain dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def contiguous_slices(count: int, parts: int) -> list[tuple[int, int]]:
    """(start, stop) of `parts` contiguous slices of range(count), sizes differing by at most 1
    (the first ones longer; some are empty when parts > count)."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class SamplingSettings:
    samples_per_prompt: int
    temperature: float
    max_new_tokens: int
    seed: int
    ignore_eos: bool = False
    """Run every request to max_new_tokens (benchmarks)."""
    max_new_tokens_by_prompt: tuple[int, ...] = ()
    """A limit per prompt of the batch, in place of max_new_tokens (benchmarks: with ignore_eos,
    a mix of completion lengths); empty: max_new_tokens for every prompt."""

    def limit(self, prompt_index: int) -> int:
        """The most tokens prompt `prompt_index` of the batch may generate."""
        return self.max_new_tokens_by_prompt[prompt_index] if self.max_new_tokens_by_prompt else self.max_new_tokens


@dataclass(frozen=True)
class Completion:
    """One sampled completion, tagged with what produced it."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    """Sampled tokens' logprobs at the sampling temperature (vLLM `processed_logprobs`)."""
    finish_reason: str
    adapter_version: int
    sigma: float
    worker_id: int


@dataclass(frozen=True)
class AdapterUpdate:
    """A LoRA adapter in flight: peft-named tensors in the engine's LoRA dtype, encoded by
    `shared.adapter_payload` (safetensors bytes in a numpy array), plus the peft config."""

    version: int
    payload: np.ndarray
    peft_config: dict


@dataclass(frozen=True)
class ServedBase:
    """The base the rollout engines load: a model folder, and vLLM's `quantization` argument
    where the engine quantizes it itself (None: dense, or the folder's own compressed-tensors
    config)."""

    path: str
    quantization: str | None
    policy_format: str


@dataclass(frozen=True)
class AdapterLoaded:
    """A worker's answer to an adapter push."""

    version: int
    load_ms: float


@dataclass(frozen=True)
class TrainSample:
    """What the learner needs of one completion."""

    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float
    staleness: int = 0
    """Adapter versions between the one that generated it and the learner's at training."""

"""Seeded learner batches for the learner's tests: short prompts and completions of a few
lengths, advantages of both signs, rollout logprobs of -3."""

from __future__ import annotations

import torch

from shared.types import TrainSample


def train_samples(count: int = 12) -> list[TrainSample]:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for index in range(count):
        prompt = torch.randint(3, 90, (5 + index % 3,), generator=generator).tolist()
        completion = torch.randint(3, 90, (2 + index % 4,), generator=generator).tolist()
        samples.append(TrainSample(prompt, completion, [-3.0] * len(completion), 1.0 if index % 2 else -1.0))
    return samples

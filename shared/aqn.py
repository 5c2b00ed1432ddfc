"""Adaptive Quantization Noise schedule (QeRL): the sigma the rollout engines use at each step.

Training is cut into K equal stages. Stage 0 runs noise-free; stages 1..K-1 decay
exponentially from sigma_start to sigma_end.
"""

from __future__ import annotations

from shared.config import AqnConfig


def aqn_sigma(config: AqnConfig, step: int, total_steps: int) -> float:
    if not config.enabled or config.num_stages < 2 or config.sigma_start == 0:
        return 0.0
    stage = min(step * config.num_stages // max(total_steps, 1), config.num_stages - 1)
    if stage == 0:
        return 0.0
    decay_stages = config.num_stages - 2
    if decay_stages == 0:
        return config.sigma_start
    fraction = (stage - 1) / decay_stages
    return config.sigma_start * (config.sigma_end / config.sigma_start) ** fraction

"""Connect to the user's Ray cluster, or start a local instance sized for the run's actors."""

from __future__ import annotations

import logging
import math
import os

import ray

from shared.config import QerlConfig


def cpus_needed(config: QerlConfig) -> int:
    rollout = config.rollout.num_workers * config.rollout.num_cpus_per_worker
    return math.ceil(rollout + config.learner.num_cpus)


def connect_ray(config: QerlConfig) -> bool:
    """Returns True when this call started a local instance (so the caller shuts it down)."""
    if ray.is_initialized():
        return False
    # quiet by default: Ray's start-up notes and the actors' output stay out of the console
    quiet = {"log_to_driver": config.ray.log_to_driver,
             "logging_level": logging.INFO if config.ray.log_to_driver else logging.ERROR}
    if config.ray.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=config.ray.address, **quiet)
        return False
    num_cpus = max(config.ray.num_cpus or os.cpu_count() or 1, cpus_needed(config))
    ray.init(num_cpus=num_cpus, include_dashboard=False, **quiet)
    return True

"""Shared fixtures: the embedded tiny model (built once per cache) and one local Ray instance."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from shared.tiny_model import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def ray_local():
    import ray

    ray.init(num_cpus=4, include_dashboard=False)
    yield ray
    ray.shutdown()

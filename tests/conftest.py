"""Shared fixtures: the embedded tiny model (built once per cache), one local Ray instance, and a
small fixed addition dataset for the end-to-end training runs."""

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


FIXED_SUMS = 16
"""Problems in the fixed dataset (test_training and test_async count on 16): with the same
prompts every step, a working loop must raise the reward within a few dozen steps."""


@pytest.fixture(scope="session")
def fixed_sums(tmp_path_factory) -> Path:
    """A JSONL file of FIXED_SUMS two-digit additions (the jsonl task end to end)."""
    import json
    from random import Random

    from shared.tasks.addition import make_addition_problem

    rng = Random(7)
    problems = [make_addition_problem(rng, 2) for _ in range(FIXED_SUMS)]
    dataset = tmp_path_factory.mktemp("sums") / "sums.jsonl"
    dataset.write_text("".join(json.dumps({"question": p.prompt, "answer": f"#### {p.answer}"}) + "\n"
                               for p in problems))
    return dataset

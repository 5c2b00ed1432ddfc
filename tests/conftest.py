"""Shared fixtures: the embedded tiny model (built once per cache), one local Ray instance, and a
small fixed addition dataset for the end-to-end training runs; and the rule that keeps the unit
tier fast.

The tiers: tests/unit (no Ray, no engine, no learner, no training: `make test-fast`),
tests/integration (one engine, one Ray actor or one learner), tests/e2e (training runs, the
fleet, resume, scale). Helper modules shared by the tiers live here, beside this file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

UNIT_TIER = Path(__file__).parent / "unit"
HEAVY_FIXTURES = {"tiny_model", "ray_local"}
"""Building the tiny model is a short training run on a fresh cache; ray_local starts Ray."""


def pytest_collection_modifyitems(config, items):
    """A unit test that starts Ray, builds the tiny model or is marked slow belongs to
    tests/integration: refuse it at collection, before the unit tier quietly slows down."""
    for item in items:
        if UNIT_TIER not in item.path.parents:
            continue
        heavy = sorted(HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())))
        if heavy or item.get_closest_marker("slow"):
            reason = f"uses {', '.join(heavy)}" if heavy else "is marked slow"
            raise pytest.UsageError(f"{item.nodeid} {reason}: move it to tests/integration or tests/e2e")


@pytest.fixture(autouse=True)
def _unit_tests_stay_fast(request, monkeypatch):
    """A unit test that reaches the embedded tiny model (often through a config whose model.path
    is null: on a fresh cache a short training run builds it) or starts Ray fails at once."""
    if UNIT_TIER not in request.path.parents:
        return

    def refuse(what: str):
        def refused(*args, **kwargs):
            raise AssertionError(f"a unit test reached {what}: move it to tests/integration "
                                 "(and ask for the tiny_model or ray_local fixture)")
        return refused

    monkeypatch.setattr("shared.tiny_model.tiny_model_path", refuse("the embedded tiny model"))
    monkeypatch.setattr("ray.init", refuse("ray.init"))


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

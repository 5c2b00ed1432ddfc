"""Asynchronous rollouts (rollout.max_staleness = 1) on the real stack: the next step's batch
generates while the learner trains, no sample trained on lags the learner by more than one
adapter version, the lag is measured and its KL reported, the run still learns, and a
checkpoint names the first prompts not trained on, so a resumed run draws them again (and
resumes with its batches ahead)."""

from __future__ import annotations

from random import Random

import pytest

from deploy.rollouts import RolloutsAhead, collect
from deploy.train import resume, start_run, train_loop
from shared.config import load_config
from shared.metrics import read_metrics

pytestmark = pytest.mark.slow
STEPS = 40
RESUMED = 3  # steps a resumed run adds
PROBLEMS = 16  # the fixed_sums fixture's problems
N = 8


@pytest.fixture(scope="module")
def async_run(tiny_model, ray_local, fixed_sums, tmp_path_factory):
    folder, dataset = tmp_path_factory.mktemp("async"), fixed_sums
    config = load_config(None, [
        "task.name=jsonl", f"task.path={dataset}", "task.prompt_template='{question}'",
        f"train.steps={STEPS}", f"train.prompts_per_step={PROBLEMS}", f"train.run_dir={folder / 'run'}",
        "train.seed=3", "rollout.num_workers=2", f"rollout.samples_per_prompt={N}", "rollout.max_new_tokens=5",
        "rollout.max_staleness=1", "rollout.chunk_sequences=32",
        "learner.lr=1e-3", "learner.warmup_steps=3", "lora.rank=8", "lora.alpha=16",
    ])
    run = start_run(config, log=lambda *_: None)
    try:
        resumed_prompts = _prompts_drawn_again_after_a_checkpoint(run)
        summary = train_loop(run, 0, Random(config.train.seed), log=print)
    finally:
        run.close()
    resume(summary["run_dir"], [f"train.steps={STEPS + RESUMED}"], log=lambda *_: None)
    return summary, resumed_prompts


def _prompts_drawn_again_after_a_checkpoint(run) -> tuple[list[str], list[str]]:
    """Batches 0-2 submitted; the sampler state a checkpoint after step 0 would keep draws
    batch 1's prompts again (batch 1 was in flight, never trained on)."""
    ahead = RolloutsAhead(run, Random(11), 0)
    ahead.submit_through(2)
    in_flight = [p.prompt for p in ahead.submitted[1].problems]
    collect(run, 0, ahead)
    state = ahead.sampler_state_after(0)
    for step in (1, 2):  # drain the queue before the real run
        run.pool.collect(ahead.take(step).batch)
    resumed_rng = Random()
    resumed_rng.setstate(state)
    again = RolloutsAhead(run, resumed_rng, 1)
    again.submit_through(1)
    drawn = [p.prompt for p in again.submitted[1].problems]
    run.pool.collect(again.take(1).batch)
    return in_flight, drawn


def test_no_sample_lags_more_than_max_staleness_and_the_lag_is_measured(async_run):
    summary, _ = async_run
    records = read_metrics(f"{summary['run_dir']}/metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS + RESUMED))  # resumed with its batches ahead
    for record in records:
        assert record["staleness/0"] + record["staleness/1"] == PROBLEMS * N  # nothing beyond 1
        assert record["rollout/stale_dropped"] == 0 and record["rollout/groups_trained"] == PROBLEMS
        assert record["step"] - 1 <= record["adapter/version_min"] <= record["step"]
    lagged = [r for r in records if r["staleness/1"] > 0]
    assert len(lagged) > STEPS // 2, "the next batch hardly ever generated during the learner's step"
    assert all("mismatch/kl_staleness_1" in r for r in lagged)
    assert max(r["async/overlap"] for r in records) > 0


def test_an_asynchronous_run_learns(async_run):
    summary, _ = async_run
    rewards = [r["rollout/reward_mean"] for r in read_metrics(f"{summary['run_dir']}/metrics.jsonl")][:STEPS]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.1, f"reward did not rise: first steps {first:.3f}, last steps {last:.3f}"


def test_a_resumed_run_draws_the_in_flight_prompts_again(async_run):
    _, (in_flight, drawn) = async_run
    assert drawn == in_flight and len(drawn) == PROBLEMS

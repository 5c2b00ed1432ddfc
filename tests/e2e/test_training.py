"""A short seeded end-to-end run: Ray, 2 vLLM workers, the NF4 + LoRA learner, AQN on.

The task is a small fixed set of addition problems read from a JSONL file (so the JSONL task
runs end to end too): with the same prompts every step, a working loop must raise the reward
within a few dozen steps (measured: about 0.6 -> 0.8 in 40 steps).
"""

from __future__ import annotations

from random import Random

import pytest
import ray
import torch

from deploy.train import start_run, train_loop
from shared.config import load_config
from shared.metrics import read_metrics

pytestmark = pytest.mark.slow
STEPS = 40
PROBLEMS = 16  # the fixed_sums fixture's problems


@pytest.fixture(scope="module")
def finished_run(tiny_model, ray_local, fixed_sums, tmp_path_factory):
    folder, dataset = tmp_path_factory.mktemp("train"), fixed_sums
    config = load_config(
        None,
        [
            "task.name=jsonl", f"task.path={dataset}", "task.prompt_template='{question}'",
            f"train.steps={STEPS}", f"train.prompts_per_step={PROBLEMS}", f"train.run_dir={folder / 'run'}",
            "train.seed=3",
            "rollout.num_workers=2", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=5",
            "learner.lr=1e-3", "learner.warmup_steps=3", "lora.rank=8", "lora.alpha=16",
        ],
    )
    run = start_run(config, log=lambda *_: None)
    try:
        before = ray.get(run.learner.parameters_snapshot.remote())
        summary = train_loop(run, 0, Random(config.train.seed), log=print)
        after = ray.get(run.learner.parameters_snapshot.remote())
    finally:
        run.close()
    return summary, before, after


def test_every_lora_parameter_changed_and_the_nf4_base_did_not(finished_run):
    _, before, after = finished_run
    assert before["lora"] and len(before["lora"]) == len(after["lora"])
    unchanged = [name for name in before["lora"] if torch.equal(before["lora"][name], after["lora"][name])]
    assert unchanged == []
    assert any(t.dtype == torch.uint8 for t in before["base"].values()), "base is not NF4-packed"
    changed_base = [name for name in before["base"] if not torch.equal(before["base"][name], after["base"][name])]
    assert changed_base == []


def test_reward_rises_and_outputs_are_written(finished_run):
    summary, _, _ = finished_run
    records = read_metrics(f"{summary['run_dir']}/metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    rewards = [r["rollout/reward_mean"] for r in records]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.1, f"reward did not rise: first steps {first:.3f}, last steps {last:.3f}"
    assert records[-1]["adapter/version"] == STEPS - 1  # completions of step s came from adapter v s
    assert max(r["aqn/sigma"] for r in records) > 0
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(summary["final_adapter"]).r == 8

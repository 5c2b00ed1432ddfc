"""A week-long run's safety end to end: `qerl train` on the embedded tiny model (real Ray, real
vLLM workers, real learner), kept to a few steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shared.metrics import read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SMALL = ["rollout.num_workers=1", "rollout.samples_per_prompt=2", "train.prompts_per_step=2",
         "train.eval_every=0", "lora.rank=8", "lora.alpha=16"]


def _qerl(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_dapo_steps_with_nothing_to_train_are_skipped_and_counted(tiny_model, tmp_path):
    """One new token cannot hold a two-digit sum: every reward is 0, dynamic sampling keeps no
    group, and no refill is allowed. The run used to die at step 0 pushing adapter version 0."""
    run_dir = tmp_path / "run"
    result = _qerl("train", "--config", "configs/tiny_cpu.yaml", *SMALL, "train.steps=2", "learner.algorithm=dapo",
                   "learner.max_refill_calls=0", "learner.overlong_buffer=0", "rollout.max_new_tokens=1",
                   f"train.run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    assert "nothing to train, learner step skipped (2 so far)" in result.stdout
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["learner/empty_steps"] for r in records] == [1, 2]
    assert (run_dir / "final_adapter" / "adapter_config.json").is_file()

"""A week-long run's safety end to end: `qerl train` on the embedded tiny model (real Ray, real
vLLM workers, real learner), kept to a few steps."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from deploy.checkpoint import complete_checkpoints
from shared.metrics import read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["rollout.num_workers=1", "rollout.samples_per_prompt=2", "train.prompts_per_step=2",
         "train.eval_every=0", "lora.rank=8", "lora.alpha=16"]


def _qerl(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


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


@pytest.fixture(scope="module")
def finished_run(tiny_model, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = _qerl("train", "--config", "configs/tiny_cpu.yaml", *SMALL, "train.steps=2", f"train.run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _contents(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run's outputs (the lock file aside), by relative path."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".qerl-driver.lock"}


# The CLI with the rollout workers failing to start (after the learner has loaded and the
# previous run was moved aside): the failure the overwrite must survive, injected.
WORKERS_FAIL = """
import sys
import deploy.train
from shared.errors import QerlError
def _no_workers(*args, **kwargs):
    raise QerlError("rollout worker 0 failed to start (injected)")
deploy.train.start_pool = _no_workers  # the run builder's pool, as train.py calls it
from deploy.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_overwrite_that_fails_keeps_the_previous_run(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = _contents(run_dir)
    overwrite = ["train", "--config", "configs/tiny_cpu.yaml", *SMALL, "train.steps=2", f"train.run_dir={run_dir}",
                 "train.overwrite=true"]
    # the case: a max_model_len the model cannot take is now refused before anything moves
    result = _qerl(*overwrite, "rollout.max_model_len=4096")
    assert result.returncode == 2 and "is more than the model's context" in result.stderr
    assert _contents(run_dir) == before
    # workers that fail once the learner has loaded
    result = subprocess.run([sys.executable, "-c", WORKERS_FAIL, *overwrite], cwd=ROOT, capture_output=True,
                            text=True, timeout=400, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2 and "failed to start (injected)" in result.stderr, result.stderr[-2000:]
    assert "the previous run in" in result.stdout and "is restored" in result.stdout
    assert _contents(run_dir) == before


def test_a_failed_resume_leaves_config_yaml_alone(finished_run, tmp_path):
    """A checkpoint whose tensors do not fit fails once the learner loads it, after the checks."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    checkpoint = complete_checkpoints(run_dir)[-1]
    state = checkpoint / "learner_state.safetensors"
    tensors = {name: tensor[..., :1].clone() if "lora" in name else tensor
               for name, tensor in load_file(str(state)).items()}
    save_file(tensors, str(state))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["learner_state.safetensors"] = hashlib.sha256(state.read_bytes()).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    config = (run_dir / "config.yaml").read_bytes()
    result = _qerl("train", "--resume", str(run_dir), "train.steps=3")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "does not fit this model" in result.stderr
    assert (run_dir / "config.yaml").read_bytes() == config

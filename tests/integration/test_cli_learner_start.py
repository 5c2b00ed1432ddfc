"""`qerl train` in a real process whose learner cannot load the model: one line naming the
learner and the cause, exit 2, and the earlier run's outputs untouched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_overwrite_keeps_the_previous_run_when_the_new_model_cannot_load(tiny_model, tmp_path):
    """Unreadable weights fail in the learner actor: one line naming the learner and the cause,
    and the earlier run's outputs are still there."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "model.safetensors").write_bytes(b"\x00" * 64)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    # a real process: Ray's start-up lines go to stderr too (the issue on console chatter), so the
    # check is that the run ends on qerl's one line, exit 2
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "train", "--config", "configs/tiny_cpu.yaml", f"model.path={model}",
         f"train.run_dir={run_dir}", "train.overwrite=true", "rollout.num_workers=1"],
        cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300,
    )
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2, result.stderr[-2000:]
    assert last.startswith(f"qerl: error: the learner could not start: cannot load the weights in {model}"), last
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n'

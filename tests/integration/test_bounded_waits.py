"""Nothing waits without bound where a remote thing can be absent, and a signal stops `qerl train`
cleanly from its first second (issue 24, item 7)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _one_line_error(capsys, args: list[str], expected: str) -> float:
    started = time.monotonic()
    code = main(args)
    seconds = time.monotonic() - started
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("qerl: error: "), err
    assert expected in err[0], err[0]
    return seconds


def test_a_wrong_ray_address_is_refused_within_seconds(tiny_model, tmp_path):
    # its own process: in this one a session fixture's Ray instance may already be up, and a run
    # started inside a caller's instance uses that one
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "--config", "configs/tiny_cpu.yaml",
                             "ray.address=127.0.0.1:1", f"train.run_dir={tmp_path / 'run'}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - started
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1 and err[0].startswith("qerl: error: "), err
    assert "cannot reach the Ray cluster at 127.0.0.1:1 (Connection refused)" in err[0], err[0]
    assert seconds < 60  # imports included; Ray's own retries took minutes


def test_an_absurd_prompts_per_step_is_refused_by_the_config(capsys):
    _one_line_error(capsys, ["train", "--config", "configs/tiny_cpu.yaml", "train.prompts_per_step=1000000000"],
                    "train.prompts_per_step: Input should be less than or equal to 100000")


def test_scale_on_a_control_file_whose_pid_is_another_process(tmp_path, capsys):
    """The pid is alive (this test's own) but no driver holds the run folder's lock."""
    (tmp_path / ".qerl-driver.lock").write_text("pid 1 on somewhere\n")
    (tmp_path / "control.json").write_text(json.dumps({"ray_address": "127.0.0.1:1", "namespace": "qerl",
                                                       "actor": "x", "pid": os.getpid(),
                                                       "host": socket.gethostname()}))
    seconds = _one_line_error(capsys, ["scale", str(tmp_path), "--workers", "2"], "control.json is stale")
    assert seconds < 5
    # a run folder from before the lock: the address is tried, briefly
    (tmp_path / ".qerl-driver.lock").unlink()
    seconds = _one_line_error(capsys, ["scale", str(tmp_path), "--workers", "2"], "cannot reach the Ray cluster")
    assert seconds < 10


@pytest.mark.slow
@pytest.mark.parametrize(("signal_number", "after_line"), [
    (signal.SIGTERM, None),  # the first second: imports
    (signal.SIGTERM, "embedded tiny model"),  # Ray starting, the learner loading
    (signal.SIGINT, "embedded tiny model"),
    (signal.SIGTERM, "learner ready"),  # the rollout engines starting
])
def test_a_signal_during_start_up_is_a_clean_stop(tiny_model, tmp_path, signal_number, after_line):
    process = subprocess.Popen([sys.executable, "-m", "deploy.cli", "train", "--config", "configs/tiny_cpu.yaml",
                                f"train.run_dir={tmp_path / 'run'}", "train.eval_every=0"], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    if after_line is None:
        time.sleep(1.0)
    else:
        while after_line not in (line := process.stdout.readline()):
            assert line, "qerl train ended before the line"
        time.sleep(1.0)
    process.send_signal(signal_number)
    _, err = process.communicate(timeout=120)
    name = signal.Signals(signal_number).name
    assert process.returncode == 128 + signal_number, err[-3000:]
    assert err.strip().splitlines()[-1] == f"qerl: stopped by {name}" and "Traceback" not in err, err[-3000:]

"""A rollout worker killed for real (SIGKILL of its process) in the middle of a run costs no
prompt group and duplicates none: its shard goes to a live worker, a replacement starts in the
background and gets the current adapter and AQN sigma before it serves, and the run finishes
every step with the event in the metrics (fleet/restarts) and in one log line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from shared.metrics import read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS = 500  # the test stops the run with SIGTERM once the replacement has served


def _rollout_worker_pids(root: int) -> list[int]:
    found = []
    for process in psutil.Process(root).children(recursive=True):
        try:
            if any("RolloutWorker" in part for part in process.cmdline()) or "RolloutWor" in process.name():
                found.append(process.pid)
        except psutil.Error:
            continue
    return found


def _wait_until(condition, process: subprocess.Popen, lines: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, "".join(lines)[-3000:]
        assert time.monotonic() < deadline, "timed out:\n" + "".join(lines)[-3000:]
        time.sleep(0.05)


def test_a_worker_killed_mid_run_is_replaced_and_no_group_is_lost(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "deploy.cli", "train", "--config", "configs/tiny_cpu.yaml",
            f"model.path={tiny_model}", f"train.steps={STEPS}", f"train.run_dir={run_dir}", "rollout.num_workers=2",
            "train.prompts_per_step=8", "rollout.samples_per_prompt=4", "lora.rank=8", "lora.alpha=16"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QERL_TEST_RUN": uuid.uuid4().hex}
    process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True).start()
    steps_done = lambda: sum(line.startswith("step ") for line in lines)  # noqa: E731
    _wait_until(lambda: steps_done() >= 2, process, lines, 300)
    victims = _rollout_worker_pids(process.pid)
    assert len(victims) == 2, f"found rollout workers {victims}"
    os.kill(victims[1], signal.SIGKILL)
    killed_at = time.monotonic()
    # Which slot that process served is Ray's choice (an actor takes any idle worker process),
    # so the driver's log line names it.
    died = lambda: [m for line in lines if (m := re.match(r"\[qerl\] rollout worker (\d+) died \(", line))]  # noqa: E731
    _wait_until(died, process, lines, 120)
    slot = died()[0].group(1)
    replaced = lambda: any(line.startswith(f"[qerl] rollout worker {slot} replaced") for line in lines)  # noqa: E731
    _wait_until(replaced, process, lines, 300)
    replaced_after = time.monotonic() - killed_at
    served_from = steps_done() + 1
    _wait_until(lambda: steps_done() >= served_from + 2, process, lines, 120)  # steps with both workers
    process.send_signal(signal.SIGTERM)  # stop cleanly, with a checkpoint
    assert process.wait(timeout=120) == 128 + signal.SIGTERM, "".join(lines)[-3000:]

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(len(records)))  # every step completed, none twice
    for record in records:  # no group lost or doubled (the driver checks each group's n), all current
        assert record["rollout/groups_trained"] == 8
        assert record["adapter/version_min"] == record["adapter/version"] == record["step"]
    assert [r["fleet/restarts"] for r in records[:2]] == [0, 0] and records[-1]["fleet/restarts"] == 1
    short = [r["step"] for r in records if r["fleet/workers"] == 1]  # the steps served by one worker
    assert short == list(range(short[0], short[-1] + 1)) and records[-1]["fleet/workers"] == 2
    assert len(died()) == 1, died()
    first_short = next(r for r in records if r["step"] == short[0])
    print(f"\nworker {slot} killed after step 1; first step without it: {first_short['time/step_s']:.1f} s; "
          f"replacement serving {replaced_after:.1f} s after the kill (steps {short[0]}-{short[-1]} on one worker)")

"""`qerl scale` on a real `qerl train` process: the fleet grows 1 -> 3 and shrinks to 2 while
it trains; every step completes once, every completion comes from the current adapter, and the
metrics show the fleet per step. A request the cluster cannot place is refused in one line and
leaves the run as it was; once the run has ended, `qerl scale` says there is no training. While
three workers serve, the run's listening sockets show that qerl opens no port beyond loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from process_sockets import listening_sockets

from shared.metrics import read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _qerl(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)


def test_scale_a_running_training_1_to_3_to_2(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "deploy.cli", "train", "--config", "configs/tiny_cpu.yaml",
            f"model.path={tiny_model}", "train.steps=1000", f"train.run_dir={run_dir}", "rollout.num_workers=1",
            "train.prompts_per_step=8", "rollout.samples_per_prompt=4", "lora.rank=8", "lora.alpha=16",
            "rollout.chunk_sequences=8", "ray.num_cpus=4", "ray.placement_timeout_s=1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QERL_TEST_RUN": uuid.uuid4().hex}
    process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True).start()
    steps = lambda: sum(line.startswith("step ") for line in lines)  # noqa: E731
    said = lambda text: any(text in line for line in lines)  # noqa: E731

    def wait_until(condition, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert process.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "timed out:\n" + "".join(lines)[-3000:]
            time.sleep(0.05)

    try:
        wait_until(lambda: steps() >= 2)
        info = json.loads((run_dir / "control.json").read_text())
        assert info["pid"] == process.pid and info["namespace"] == "qerl"

        grow = _qerl("scale", str(run_dir), "--workers", "3")
        assert grow.returncode == 0, grow.stderr
        assert "rollout workers 1 -> 3 from the next step" in grow.stdout
        wait_until(lambda: said("rollout worker 1 added") and said("rollout worker 2 added"))
        wait_until(lambda: _steps_with(run_dir, 3) >= 2)
        _assert_only_ray_listens_beyond_loopback(process.pid)

        too_many = _qerl("scale", str(run_dir), "--workers", "40", "--wait", "1")
        assert too_many.returncode == 2 and too_many.stderr.count("\n") == 1, too_many.stderr
        assert "cannot place 37 more rollout worker(s)" in too_many.stderr
        assert "the run goes on with 3" in too_many.stderr

        shrink = _qerl("scale", str(run_dir), "--workers", "2")
        assert shrink.returncode == 0, shrink.stderr
        wait_until(lambda: said("rollout worker 2 retired"))
        wait_until(lambda: _steps_with(run_dir, 2, after_three=True) >= 2)
    finally:
        process.send_signal(signal.SIGTERM)  # stop cleanly, with a checkpoint
        process.wait(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, "".join(lines)[-3000:]

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(len(records)))  # every step completed, none twice
    for record in records:
        assert record["rollout/groups_trained"] == 8
        assert record["adapter/version_min"] == record["adapter/version"] == record["step"]
        serving = [k for k in record if k.startswith("fleet/worker") and k.endswith("/requests")]
        assert len(serving) >= record["fleet/workers"]  # per-worker metrics for each serving worker
        assert sum(record[k] for k in serving) == 4  # 8 prompts x 4 samples in chunks of 8 sequences
    fleet = [r["fleet/workers"] for r in records]
    top = fleet.index(3)
    assert fleet[0] == 1 and set(fleet[:top]) <= {1, 2} and fleet[-1] == 2
    assert fleet[top:] == sorted(fleet[top:], reverse=True)  # 3 ... 3, then 2 ... 2
    assert max(r["fleet/target"] for r in records) == 3  # the refused request never reached the run
    assert not (run_dir / "control.json").exists()
    ended = _qerl("scale", str(run_dir), "--workers", "2")
    assert ended.returncode == 2 and "no running training" in ended.stderr


def _steps_with(run_dir: Path, workers: int, after_three: bool = False) -> int:
    """Steps logged so far with `workers` serving (after the fleet first reached 3)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    fleet = [json.loads(line)["fleet/workers"] for line in path.read_text().splitlines() if line.strip()]
    if after_three:
        fleet = fleet[fleet.index(3):] if 3 in fleet else []
    return sum(size == workers for size in fleet)


# Ray 2.60's own servers listen on every interface whatever the node address (README, Security);
# these processes run no qerl code.
RAY_SERVERS = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray/dashboard/",
               "ray/autoscaler/")


def _assert_only_ray_listens_beyond_loopback(pid: int) -> None:
    """Every process of a local run: Ray's servers may listen anywhere; a process that runs qerl
    code (the driver, each actor) has exactly one listener beyond loopback, its Ray core worker's;
    the dashboard's HTTP port (8265) is closed. An extra port opened by qerl, vLLM or torch on a
    non-loopback address fails here."""
    outside: dict[str, list[str]] = {}
    for process, sockets in listening_sockets(pid).items():
        assert all(address.port != 8265 for address in sockets), f"{process[:80]} serves the dashboard"
        beyond = [f"{a.ip}:{a.port}" for a in sockets if not (a.ip.startswith("127.") or a.ip == "::1")]
        if beyond and not any(server in process for server in RAY_SERVERS):
            outside[process[:90]] = beyond
    assert outside, "no qerl process listened at all: the check saw nothing"
    extra = {process: ports for process, ports in outside.items() if len(ports) > 1}
    assert not extra, f"qerl processes listening beyond loopback on more than Ray's core-worker port: {extra}"
    assert len(outside) >= 5, outside  # the driver, the learner, the fleet control and 3 rollout workers

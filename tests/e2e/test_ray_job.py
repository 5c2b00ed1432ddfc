"""qerl as a Ray job, for real: a local head on loopback (`ray start --head`, the dashboard and
job server on 127.0.0.1), a short training run submitted through the Ray Jobs API with this
repository as its working_dir, its outputs and logs checked, then the head stopped. Also the
errors a new user hits on a cluster: a relative train.run_dir inside a job, and a driver
without RAY_AUTH_MODE=token refused by a token-auth head."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from process_sockets import listening_sockets

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
RUNTIME_ENV = yaml.safe_load((ROOT / "deploy" / "cluster" / "runtime_env.yaml").read_text())


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _wait_for_port(port: int, head: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert head.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, f"the head's dashboard did not listen on {port} in {timeout_s} s"
            time.sleep(1)


@pytest.fixture(scope="module")
def ray_head():
    """A head of its own (its own ports, temp folder and session), stopped by signalling its
    process group: `ray stop` would stop every Ray instance on the machine."""
    gcs, dashboard, agent_http, agent_grpc, runtime_env_agent, metrics = _free_ports(6)
    temp_dir = tempfile.mkdtemp(prefix="qerl-ray-", dir="/tmp")  # short: Ray's socket paths
    env = os.environ | {"RAY_AUTH_MODE": "token"}
    ray_cli = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={runtime_env_agent}", f"--metrics-export-port={metrics}",
         "--num-cpus=3", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_port(dashboard, head)
        yield {"gcs": f"127.0.0.1:{gcs}", "jobs": f"http://127.0.0.1:{dashboard}", "dashboard_port": dashboard,
               "pid": head.pid}
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # raylet and GCS can outlive `ray start --block`
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)


# The Jobs API client runs as a user's submitting process would: its own interpreter, with
# RAY_AUTH_MODE=token in its environment (Ray reads the mode once, at import).
JOBS_CLIENT = """
import json, sys, time
from ray.job_submission import JobStatus, JobSubmissionClient

address, runtime_env, entrypoints = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
deadline = time.monotonic() + 120
while True:  # the head's job agent takes submissions some seconds after the head is up
    try:
        client = JobSubmissionClient(address)
        jobs = [client.submit_job(entrypoint=e, runtime_env=runtime_env) for e in entrypoints]
        break
    except (ConnectionError, RuntimeError) as error:
        if time.monotonic() > deadline:
            raise
        time.sleep(2)
results = []
for job in jobs:
    while not (status := client.get_job_status(job)).is_terminal():
        time.sleep(2)
    results.append({"status": str(status), "logs": client.get_job_logs(job)})
print(json.dumps(results))
"""


def _run_jobs(address: str, entrypoints: list[str]) -> list[dict]:
    env_vars = {"RAY_AUTH_MODE": "token"} | ({"QERL_CACHE_DIR": os.environ["QERL_CACHE_DIR"]}
                                             if "QERL_CACHE_DIR" in os.environ else {})
    runtime_env = {"working_dir": str(ROOT), "excludes": RUNTIME_ENV["excludes"], "env_vars": env_vars}
    result = subprocess.run([sys.executable, "-c", JOBS_CLIENT, address, json.dumps(runtime_env), *entrypoints],
                            capture_output=True, text=True, timeout=900, env=os.environ | {"RAY_AUTH_MODE": "token"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_training_run_submitted_as_a_ray_job(ray_head, tiny_model, tmp_path):
    run_dir = tmp_path / "job-run"
    train = (f"{sys.executable} -m deploy.cli train --config configs/tiny_cpu.yaml model.path={tiny_model} "
             f"train.steps=2 train.prompts_per_step=4 rollout.num_workers=1 train.run_dir=")
    job, relative = _run_jobs(ray_head["jobs"], [train + str(run_dir), train + "runs/relative-in-a-job"])
    assert job["status"] == "SUCCEEDED", job["logs"][-3000:]
    assert "step    1 |" in job["logs"] and "[qerl] final adapter" in job["logs"]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert (run_dir / "final_adapter" / "adapter_model.safetensors").is_file()
    assert (run_dir / "logs" / "learner.log").is_file()  # the actors' output went to the run folder

    assert relative["status"] == "FAILED"
    last = relative["logs"].strip().splitlines()[-1]
    assert last.startswith("qerl: error: train.run_dir runs/relative-in-a-job is relative, and this is a Ray job"), last
    assert not (ROOT / "runs" / "relative-in-a-job").exists()


def test_the_heads_job_server_listens_on_loopback_only(ray_head):
    listening = {(a.ip, a.port) for sockets in listening_sockets(ray_head["pid"]).values() for a in sockets}
    dashboard = {ip for ip, port in listening if port == ray_head["dashboard_port"]}
    assert dashboard == {"127.0.0.1"}, f"the job server listens on {dashboard}"


def test_a_driver_without_the_token_gets_told_what_to_set(ray_head):
    script = ("import ray, sys\nfrom deploy.ray_cluster import connection_hint\n"
              f"try:\n    ray.init(address='{ray_head['gcs']}')\nexcept ConnectionError as e:\n"
              f"    print(connection_hint('{ray_head['gcs']}', e)); sys.exit(3)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"})
    assert result.returncode == 3, result.stderr[-2000:]
    assert "set RAY_AUTH_MODE=token" in result.stdout

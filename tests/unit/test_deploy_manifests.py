"""The cluster pieces in deploy/cluster/ are consistent with each other and with the config they
launch: YAML that parses, the fields Ray and KubeRay require, and resources that match what the
entrypoint's config asks for (a mismatch would leave the job waiting for actors it cannot place)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import yaml

from deploy.ray_cluster import actor_needs, unplaceable
from shared.config import load_config

ROOT = Path(__file__).parents[2]
CLUSTER = ROOT / "deploy" / "cluster"


def _yaml(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def _entrypoint_config(command: str):
    words = shlex.split(command)
    assert words[:4] == ["python", "-m", "deploy.cli", "train"], "the job must not rely on `qerl` being on PATH"
    config_path = words[words.index("--config") + 1]
    assert (ROOT / config_path).is_file(), f"the entrypoint's config {config_path} is not in the repo"
    return load_config(ROOT / config_path, words[words.index("--config") + 2:])


def test_the_rayjob_manifest_has_what_kuberay_requires():
    job = _yaml("rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert {group["groupName"] for group in cluster["workerGroupSpecs"]} == {"learner", "rollout"}
    # the job server listens on the head's loopback only
    assert cluster["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]["RAY_AUTH_MODE"] == "token"


def _group_nodes(group: dict) -> list[dict[str, float]]:
    params = group["rayStartParams"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    # what Ray is told a pod has must be what Kubernetes gives it
    assert float(params["num-gpus"]) == float(limits.get("nvidia.com/gpu", 0))
    assert float(params["num-cpus"]) <= float(limits["cpu"])
    return [{"CPU": float(params["num-cpus"]), "GPU": float(params["num-gpus"])}] * group["replicas"]


def test_the_rayjob_groups_place_exactly_the_entrypoints_actors():
    job = _yaml("rayjob.yaml")
    config = _entrypoint_config(job["spec"]["entrypoint"])
    groups = {group["groupName"]: group for group in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    nodes = _group_nodes(groups["learner"]) + _group_nodes(groups["rollout"])
    assert unplaceable(actor_needs(config), nodes) is None
    # one rollout pod per worker, and the learner's GPU on a pod of its own
    assert groups["rollout"]["replicas"] == config.rollout.num_workers
    assert config.learner.num_gpus == float(groups["learner"]["rayStartParams"]["num-gpus"])
    assert config.train.run_dir.startswith("/shared/")  # absolute and on the shared volume


def test_the_ray_up_config_places_the_same_run():
    cluster = _yaml("ray-cluster.yaml")
    for key in ("cluster_name", "provider", "head_node_type", "available_node_types"):
        assert key in cluster
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    nodes = [types[name]["resources"] for name in types if name != cluster["head_node_type"]
             for _ in range(types[name]["min_workers"])]
    config = _entrypoint_config("python -m deploy.cli train --config configs/qwen2.5-7b_cluster.yaml")
    assert unplaceable(actor_needs(config), nodes) is None
    head_start = " ".join(cluster["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start


def test_the_submit_script_and_runtime_env_agree():
    script = (CLUSTER / "submit.sh").read_text()
    assert "-- python -m deploy.cli train" in script and "deploy/cluster/runtime_env.yaml" in script
    subprocess.run(["bash", "-n", str(CLUSTER / "submit.sh")], check=True)
    env = _yaml("runtime_env.yaml")
    assert env["working_dir"] == "." and ".venv" in env["excludes"]
    assert env["env_vars"]["RAY_AUTH_MODE"] == "token"
    default = script.split('config="${1:-')[1].split("}")[0]
    _entrypoint_config(f"python -m deploy.cli train --config {default}")


def test_the_dockerfile_installs_the_gpu_extra_and_every_package():
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert '".[gpu]"' in dockerfile
    for package in ("shared", "learner", "rollout_server", "deploy", "configs"):
        assert f"COPY {package} {package}" in dockerfile

"""Placement is checked before any actor starts: the packing of actors onto nodes, what each
actor needs, where a Ray job may write, and the hint a driver without the cluster token gets."""

from __future__ import annotations

import pytest

from deploy.ray_cluster import ActorNeed, actor_needs, check_run_dir_for_job, connection_hint, unplaceable
from shared.config import load_config
from shared.errors import QerlError


def test_actors_are_packed_onto_nodes_as_ray_would():
    needs = [ActorNeed("the learner", 1, 1), ActorNeed("rollout worker 0", 1, 1), ActorNeed("rollout worker 1", 1, 1)]
    assert unplaceable(needs, [{"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 1}]) is None
    # three GPUs in all but no node has room for the third actor's
    problem = unplaceable(needs, [{"CPU": 8, "GPU": 2}, {"CPU": 8}])
    assert problem.startswith("rollout worker 1 (1 CPU, 1 GPU) does not fit: the run asks for 3 CPUs and 3 GPUs")
    assert "2 node(s) with 16 CPUs and 2 GPUs" in problem
    # fractional GPUs share a device
    halves = [ActorNeed(f"rollout worker {i}", 0.5, 0.5) for i in range(2)]
    assert unplaceable(halves, [{"CPU": 1, "GPU": 1}]) is None


def test_actor_needs_follow_the_config():
    config = load_config(None, ["rollout.num_workers=3", "rollout.num_gpus_per_worker=0.5", "learner.num_gpus=1"])
    needs = actor_needs(config)
    assert [n.name for n in needs] == ["the learner", "rollout worker 0", "rollout worker 1", "rollout worker 2"]
    assert needs[0].gpus == 1 and {n.gpus for n in needs[1:]} == {0.5}


def test_a_relative_run_dir_is_refused_only_inside_a_ray_job(monkeypatch):
    check_run_dir_for_job("runs/x")  # a plain `qerl train`: relative to where it runs
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    check_run_dir_for_job("/shared/runs/x")
    with pytest.raises(QerlError, match="train.run_dir runs/x is relative, and this is a Ray job"):
        check_run_dir_for_job("runs/x")


def test_the_hint_is_left_out_once_token_auth_is_set(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    line = connection_hint("10.0.0.1:6379", ConnectionError("Failed to connect"))
    assert line == "cannot connect to the Ray cluster at 10.0.0.1:6379 (Failed to connect)"

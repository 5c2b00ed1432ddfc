"""Placement is checked before any actor starts: a run the cluster cannot place stops with one
line naming what did not fit (Ray itself would wait for the resources forever, silently)."""

from __future__ import annotations

import pytest

from deploy.ray_cluster import ActorNeed, actor_needs, check_cluster_fits, check_run_dir_for_job, unplaceable
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


def test_a_run_the_local_cluster_cannot_place_is_one_line(ray_local):
    fits = load_config(None, ["rollout.num_workers=2"])
    check_cluster_fits(fits, 0.0)
    gpu_run = load_config(None, ["rollout.num_gpus_per_worker=1"])
    with pytest.raises(QerlError) as error:
        check_cluster_fits(gpu_run, 1.0, log=lambda line: None)
    message = str(error.value)
    assert message.startswith("the Ray cluster cannot place this run: rollout worker")
    assert "waited 1 s (ray.placement_timeout_s)" in message and "\n" not in message


def test_a_relative_run_dir_is_refused_only_inside_a_ray_job(monkeypatch):
    check_run_dir_for_job("runs/x")  # a plain `qerl train`: relative to where it runs
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    check_run_dir_for_job("/shared/runs/x")
    with pytest.raises(QerlError, match="train.run_dir runs/x is relative, and this is a Ray job"):
        check_run_dir_for_job("runs/x")


@pytest.mark.slow
def test_a_worker_that_cannot_see_the_rollout_base_says_so(ray_local, tmp_path):
    from rollout_server.pool import RolloutPool
    from shared.types import ServedBase

    missing = tmp_path / "rollout_base"  # as on a node without the learner's storage
    config = load_config(None, ["rollout.num_workers=1"]).rollout
    with pytest.raises(QerlError) as error:
        RolloutPool(ServedBase(str(missing), None, "nf4-exact"), config, 8, log=lambda line: None)
    message = str(error.value)
    assert message.startswith("rollout worker 0 could not start: rollout worker 0 on ")
    assert f"the rollout base {missing} is not on this node" in message and "\n" not in message

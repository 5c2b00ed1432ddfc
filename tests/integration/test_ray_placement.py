"""Placement on a real local Ray: a run the cluster cannot place, and a worker that cannot see
the rollout base, each end in one line."""

from __future__ import annotations

import pytest

from deploy.ray_cluster import check_cluster_fits
from shared.config import load_config
from shared.errors import QerlError


def test_a_run_the_local_cluster_cannot_place_is_one_line(ray_local):
    fits = load_config(None, ["rollout.num_workers=2"])
    check_cluster_fits(fits, 0.0)
    gpu_run = load_config(None, ["rollout.num_gpus_per_worker=1"])
    with pytest.raises(QerlError) as error:
        check_cluster_fits(gpu_run, 1.0, log=lambda line: None)
    message = str(error.value)
    assert message.startswith("the Ray cluster cannot place this run: rollout worker")
    assert "waited 1 s (ray.placement_timeout_s)" in message and "\n" not in message


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

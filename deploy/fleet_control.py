"""`qerl scale RUN_DIR --workers N`: change the rollout fleet of a running training.

The channel goes through Ray itself, never an open port of qerl's: the training's driver owns a
small named actor (`FleetControl`, in the "qerl" namespace, named after the run folder) and
writes where to find it to RUN_DIR/control.json. `qerl scale` joins the same Ray cluster, checks
that the cluster can place the extra workers, and leaves the request with the actor; the driver
takes it at the next step boundary (`RolloutPool.scale`). The actor dies with the driver and the
file is removed when the run ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

import ray

from deploy.ray_cluster import ActorNeed, check_reachable, connection_hint, unplaceable
from deploy.run_folder import driver_holds_lock
from shared.errors import QerlError

NAMESPACE = "qerl"
CONTROL_FILE = "control.json"


class FleetControl:
    """The mailbox between `qerl scale` and the driver (a Ray actor that needs no CPU)."""

    def __init__(self):
        self.requested: int | None = None
        self.status: dict = {}

    def request(self, workers: int) -> dict:
        self.requested = workers
        return self.status

    def exchange(self, status: dict) -> int | None:
        """The driver's call at a step boundary: publish the fleet's status, take the request."""
        self.status = status
        requested, self.requested = self.requested, None
        return requested

    def current(self) -> dict:
        return self.status


def actor_name(run_dir: Path) -> str:
    return "qerl-fleet-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


class ControlChannel:
    """The driver's side: the named actor and RUN_DIR/control.json, for the run's lifetime."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / CONTROL_FILE
        name = actor_name(run_dir)
        try:
            self.actor = ray.remote(FleetControl).options(name=name, namespace=NAMESPACE, num_cpus=0).remote()
            ray.get(self.actor.current.remote())
        except ValueError:  # the name is taken: a live driver on this folder owns it
            raise QerlError(f"another qerl train is running in {run_dir} (its fleet control {name} is live)") from None
        info = {"ray_address": ray.get_runtime_context().gcs_address, "namespace": NAMESPACE, "actor": name,
                "pid": os.getpid(), "host": socket.gethostname()}
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(info) + "\n")
        os.replace(temporary, self.path)

    def exchange(self, status: dict) -> int | None:
        return ray.get(self.actor.exchange.remote(status))

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        ray.kill(self.actor)


def _running_training(run_dir: Path) -> dict:
    path = run_dir / CONTROL_FILE
    if not path.is_file():
        raise QerlError(f"{run_dir}: no running training (no {CONTROL_FILE}; it exists while qerl train runs)")
    try:
        info = json.loads(path.read_text())
        address, pid, host = info["ray_address"], int(info["pid"]), info["host"]
    except (ValueError, KeyError, TypeError) as error:
        raise QerlError(f"{path} is not a qerl control file ({error})") from None
    # the pid may belong to another process by now; the folder's lock dies with its driver
    if host == socket.gethostname() and (not _process_alive(pid) or driver_holds_lock(run_dir) is False):
        raise QerlError(f"{run_dir}: no running training (its driver, pid {pid}, has ended; {CONTROL_FILE} is stale)")
    return {**info, "ray_address": address}


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_resources_per_node() -> list[dict[str, float]]:
    """What each alive node has free now (Ray's per-node view; the cluster's total where this Ray
    does not offer it)."""
    try:
        from ray._private.state import available_resources_per_node

        return list(available_resources_per_node().values())
    except (ImportError, AttributeError):
        return [ray.available_resources()]


def scale(run_dir: str, workers: int, wait_s: float | None = None, log=print) -> dict:
    """Ask the training running in `run_dir` for `workers` rollout workers from its next step.
    Growing is refused (the run unaffected) when the cluster cannot place the extra workers
    within `wait_s` (default: the run's ray.placement_timeout_s)."""
    if workers < 1:
        raise QerlError(f"--workers must be at least 1, not {workers}")
    folder = Path(run_dir).resolve()
    info = _running_training(folder)
    check_reachable(info["ray_address"])
    try:
        ray.init(address=info["ray_address"], namespace=info["namespace"], log_to_driver=False,
                 logging_level="ERROR")
    except ConnectionError as error:
        raise QerlError(connection_hint(info["ray_address"], error)) from None
    try:
        try:
            control = ray.get_actor(info["actor"], namespace=info["namespace"])
            status = ray.get(control.current.remote())
        except (ValueError, ray.exceptions.RayActorError):
            raise QerlError(f"{folder}: no running training (its fleet control is gone)") from None
        if not status:
            raise QerlError(f"{folder}: the training has not finished starting; try again in a moment")
        extra = workers - int(status["target"])
        if extra > 0:
            _wait_for_room(extra, status, status["placement_timeout_s"] if wait_s is None else wait_s, log)
        ray.get(control.request.remote(workers))
    finally:
        ray.shutdown()
    log(f"[qerl] {folder}: rollout workers {status['target']} -> {workers} from the next step "
        f"(the run is at step {status['step']}, {status['workers']} serving)")
    return status


def _wait_for_room(extra: int, status: dict, wait_s: float, log) -> None:
    needs = [ActorNeed(f"new rollout worker {i + 1} of {extra}", status["cpus_per_worker"], status["gpus_per_worker"])
             for i in range(extra)]
    deadline, said = time.monotonic() + wait_s, False
    while (problem := unplaceable(needs, _free_resources_per_node())) is not None:
        if time.monotonic() >= deadline:
            hint = " (a local Ray instance keeps the CPUs it started with: ray.num_cpus)" if status["local_ray"] else ""
            raise QerlError(f"the Ray cluster cannot place {extra} more rollout worker(s) in what is free now: "
                            f"{problem}{hint}; the run goes on with {status['target']}")
        if not said:
            log(f"[qerl] waiting up to {wait_s:g} s for room for {extra} more rollout worker(s)")
            said = True
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

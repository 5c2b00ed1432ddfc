"""Connect to the user's Ray cluster, or start a local instance sized for the run's actors, and
check before any actor starts that the cluster can place them."""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from shared.config import QerlConfig
from shared.errors import QerlError

# Set by Ray's job supervisor in a submitted job's entrypoint process.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


@dataclass(frozen=True)
class ActorNeed:
    name: str
    cpus: float
    gpus: float


def actor_needs(config: QerlConfig) -> list[ActorNeed]:
    """What each actor of a run asks Ray for: the learner, then every rollout worker."""
    rollout = config.rollout
    return [ActorNeed("the learner", config.learner.num_cpus, config.learner.num_gpus)] + [
        ActorNeed(f"rollout worker {i}", rollout.num_cpus_per_worker, rollout.num_gpus_per_worker)
        for i in range(rollout.num_workers)
    ]


def cpus_needed(config: QerlConfig) -> int:
    return math.ceil(sum(need.cpus for need in actor_needs(config)))


def unplaceable(needs: list[ActorNeed], nodes: list[dict[str, float]]) -> str | None:
    """Why `needs` cannot all be placed on nodes with these total resources (first fit, largest
    first, as Ray packs actors), or None when they can."""
    free = [{"CPU": node.get("CPU", 0.0), "GPU": node.get("GPU", 0.0)} for node in nodes]
    for need in sorted(needs, key=lambda n: (n.gpus, n.cpus), reverse=True):
        node = next((f for f in free if f["CPU"] >= need.cpus - 1e-9 and f["GPU"] >= need.gpus - 1e-9), None)
        if node is None:
            total_cpus = sum(n.get("CPU", 0.0) for n in nodes)
            total_gpus = sum(n.get("GPU", 0.0) for n in nodes)
            asked_cpus, asked_gpus = sum(n.cpus for n in needs), sum(n.gpus for n in needs)
            return (f"{need.name} ({need.cpus:g} CPU, {need.gpus:g} GPU) does not fit: the run asks for "
                    f"{asked_cpus:g} CPUs and {asked_gpus:g} GPUs in all, the cluster has {len(nodes)} node(s) "
                    f"with {total_cpus:g} CPUs and {total_gpus:g} GPUs (rollout.num_workers, "
                    f"rollout.num_cpus_per_worker/num_gpus_per_worker and learner.num_cpus/num_gpus set what is asked)")
        node["CPU"] -= need.cpus
        node["GPU"] -= need.gpus
    return None


def _alive_node_resources() -> list[dict[str, float]]:
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def check_cluster_fits(config: QerlConfig, wait_s: float, log=print) -> None:
    """Raise a QerlError naming what does not fit once `wait_s` has passed without the cluster
    growing enough (Ray would otherwise wait for the resources forever, silently)."""
    needs = actor_needs(config)
    deadline = time.monotonic() + wait_s
    said = False
    while (problem := unplaceable(needs, _alive_node_resources())) is not None:
        if time.monotonic() >= deadline:
            raise QerlError(f"the Ray cluster cannot place this run: {problem}"
                            + (f"; waited {wait_s:g} s (ray.placement_timeout_s)" if wait_s else ""))
        if not said:
            log(f"[qerl] waiting up to {wait_s:g} s for the cluster to grow: {problem}")
            said = True
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


def connect_ray(config: QerlConfig, log=print) -> bool:
    """Returns True when this call started a local instance (so the caller shuts it down)."""
    if ray.is_initialized():  # the caller's own instance (tests, notebooks)
        check_cluster_fits(config, 0.0, log)
        return False
    # quiet by default: Ray's start-up notes and the actors' output stay out of the console
    quiet = {"log_to_driver": config.ray.log_to_driver,
             "logging_level": logging.INFO if config.ray.log_to_driver else logging.ERROR}
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        check_reachable(address)
        try:
            with keep_signal_handlers():
                ray.init(address=config.ray.address, **quiet)
        except ConnectionError as error:
            raise QerlError(connection_hint(address, error)) from None
        wait_s = config.ray.placement_timeout_s
    else:
        num_cpus = max(config.ray.num_cpus or os.cpu_count() or 1, cpus_needed(config))
        # the dashboard stays off; nothing of the local instance is meant to be reached from outside
        try:
            with keep_signal_handlers():
                ray.init(num_cpus=num_cpus, include_dashboard=False, **quiet)
        except BaseException:  # a signal mid-start: the half-started instance goes too
            ray.shutdown()
            raise
        wait_s = 0.0  # a local instance does not grow
    try:
        check_cluster_fits(config, wait_s, log)
    except BaseException:
        ray.shutdown()  # this call connected: leave nothing behind
        raise
    return not address


REACH_TIMEOUT_S = 5.0


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """A host:port address whose port does not answer is a one-line error within `timeout_s`;
    ray.init would retry it for minutes without a word (other forms are left to Ray)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as error:
        why = error.strerror or f"no answer within {timeout_s:g} s"
        raise QerlError(f"cannot reach the Ray cluster at {address} ({why}); check ray.address (the head's "
                        f"host:port, 6379 by default) and that the head is running") from None


class keep_signal_handlers:  # noqa: N801 - used as a `with` statement
    """ray.init makes SIGTERM call sys.exit in the driver; the driver keeps its own handlers
    (a signal during start-up is a clean stop with one line, see deploy/cli.py)."""

    def __enter__(self):
        main = threading.current_thread() is threading.main_thread()
        self.saved = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)} if main else {}

    def __exit__(self, exc_type, exc, traceback) -> None:
        for number, handler in self.saved.items():
            if handler is not None:
                signal.signal(number, handler)
        if self.saved and exc_type is SystemExit and exc.code == signal.SIGTERM:  # Ray's handler, mid-init
            raise KeyboardInterrupt("SIGTERM") from None


def connection_hint(address: str, error: BaseException) -> str:
    """One line for a failed ray.init(address=...): Ray 2.60 heads use token authentication by
    default, and a driver without RAY_AUTH_MODE=token is refused with no word of why (the cause,
    InvalidAuthToken, is only in Ray's C++ log)."""
    line = f"cannot connect to the Ray cluster at {address} ({str(error).splitlines()[0][:200]})"
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        line += ("; if the head was started by Ray 2.60 or later it uses token authentication: set "
                 "RAY_AUTH_MODE=token, with the head's token in RAY_AUTH_TOKEN or ~/.ray/auth_token")
    return line


def check_run_dir_for_job(run_dir: str) -> None:
    """A Ray job's entrypoint runs in Ray's temporary copy of its working_dir, deleted with the
    job: a relative train.run_dir would put the run there."""
    if RAY_JOB_ENV in os.environ and not Path(run_dir).is_absolute():
        raise QerlError(f"train.run_dir {run_dir} is relative, and this is a Ray job, whose working directory "
                        f"is Ray's temporary copy of its working_dir (deleted with the job): give an absolute "
                        f"path on storage every node mounts")

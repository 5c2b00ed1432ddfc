"""Where an actor process's own output goes: vLLM, torch, NCCL and Ray print at the C level as
well as from Python, so the file descriptors themselves are redirected."""

from __future__ import annotations

import os
import sys
from pathlib import Path

LOG_FILE_ENV = "QERL_LOG_FILE"


def redirect_output_to_log_file() -> None:
    """Append this process's stdout and stderr to $QERL_LOG_FILE (set by the driver through
    Ray's runtime_env); nothing happens where it is unset."""
    log_file = os.environ.get(LOG_FILE_ENV)
    if not log_file:
        return
    path = Path(log_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)


def actor_log_env(log_dir: str | Path | None, name: str) -> dict[str, str]:
    return {LOG_FILE_ENV: str(Path(log_dir) / f"{name}.log")} if log_dir else {}

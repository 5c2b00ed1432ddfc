"""A run folder's safety: one driver at a time, and an overwrite that keeps the previous run
until the new one has proved itself.

The lock is `RUN_DIR/.qerl-driver.lock`, held with flock by the driver for its whole life (train
or --resume) and removed when it ends: the kernel drops the flock when the process ends, however
it ends, so a lock file left by a killed driver is simply taken over; the file names the
holder's pid for the refusal's message.

`train.overwrite=true` moves the previous run's outputs into `RUN_DIR/.previous-run/`; they are
deleted once the new run has written its first checkpoint, and moved back if it fails before.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from pathlib import Path

from shared.errors import QerlError

LOCK_FILE = ".qerl-driver.lock"
PREVIOUS_RUN = ".previous-run"
# what a run writes into its folder (control.json is the live driver's, the lock is the lock)
RUN_OUTPUTS = ("metrics.jsonl", "config.yaml", "checkpoints", "final_adapter", "tensorboard", "logs",
               "rollout_base", "report.png")


def make_run_dir(run_dir: Path) -> Path:
    """The run folder, created; a one-line error where it cannot be (e.g. under a file)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise QerlError(f"train.run_dir {run_dir} cannot be created: {error.strerror}") from None
    if not run_dir.is_dir():
        raise QerlError(f"train.run_dir {run_dir} is a file, not a folder")
    return run_dir


class RunLock:
    """The run folder's driver lock, held until `release` (or the process's end)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        while True:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(descriptor, 200, 0).decode(errors="replace").strip() or "unknown pid"
                os.close(descriptor)
                raise QerlError(f"{run_dir} is in use by another qerl train ({holder}); wait for it to end or "
                                f"stop it, or pick another train.run_dir") from None
            if _same_file(descriptor, self.path):
                break
            os.close(descriptor)  # a driver that just ended removed that file: lock the new one
        self._fd: int | None = descriptor
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        """The file goes while still locked (a run folder holds no trace of a driver that ended
        cleanly); closing drops the lock."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(descriptor).st_ino
    except FileNotFoundError:
        return False


def remove_if_empty(run_dir: Path) -> None:
    """A run folder this driver created and left empty (its run was refused before writing
    anything): gone, as if never tried."""
    try:
        if run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()
    except OSError:  # another driver got there in between: the folder is its now
        pass


def driver_holds_lock(run_dir: Path) -> bool | None:
    """Whether a live driver holds the run folder's lock (None: no lock file, an older run). Unlike
    a pid, which the system may have given to another process since, it dies with its driver."""
    path = Path(run_dir) / LOCK_FILE
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)


def move_previous_run_aside(run_dir: Path) -> None:
    """Before an overwrite: the previous run's outputs into .previous-run/. An earlier overwrite
    that never reached its first checkpoint left one there already: that one is the real previous
    run, and what lies in the folder now is the failed attempt's."""
    aside = run_dir / PREVIOUS_RUN
    keep_existing = aside.is_dir()
    present = [name for name in RUN_OUTPUTS if (run_dir / name).exists() or (run_dir / name).is_symlink()]
    if not present:  # nothing to keep: a failure of this run leaves its own logs alone
        return
    aside.mkdir(exist_ok=True)
    for name in present:
        path = run_dir / name
        if keep_existing:
            _remove(path)
        else:
            os.replace(path, aside / name)


def restore_previous_run(run_dir: Path) -> bool:
    """The new run failed before its first checkpoint: its outputs go, the previous run's come back."""
    aside = run_dir / PREVIOUS_RUN
    if not aside.is_dir():
        return False
    for name in RUN_OUTPUTS:
        _remove(run_dir / name)
        if (aside / name).exists():
            os.replace(aside / name, run_dir / name)
    shutil.rmtree(aside, ignore_errors=True)
    return True


def discard_previous_run(run_dir: Path) -> None:
    """The new run has a checkpoint: the previous run is gone for good."""
    shutil.rmtree(Path(run_dir) / PREVIOUS_RUN, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)

"""Checkpoints of a training run: written atomically, verified when read.

A checkpoint is a folder `run_dir/checkpoints/step-NNNNNN` (N = the number of steps done):
the learner's files (a standard peft adapter folder in `adapter/`, its optimizer, schedule and
RNG state in safetensors + JSON), the driver's state (`driver.json`: the task sampler's RNG,
the step, the adapter version, the AQN sigma) and `manifest.json` with every file's SHA-256.
It is written into a `.tmp-*` folder, each file fsynced, then renamed into place, so a crash at
any moment leaves either the complete new checkpoint or none; the oldest go beyond `keep`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from deploy.run_folder import PREVIOUS_RUN
from shared.errors import QerlError

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
_PREFIX = "step-"
REQUIRED = ("driver.json", "learner_state.safetensors", "learner_state.json")


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def _fsync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_synced(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_checkpoint(run_dir: Path, steps_done: int, files: dict[str, bytes], keep: int) -> Path:
    """Write `files` (relative path -> bytes) as the checkpoint after `steps_done` steps."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{steps_done:06d}"
    temporary = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    manifest = {}
    for name, data in files.items():
        _write_synced(temporary / name, data)
        manifest[name] = hashlib.sha256(data).hexdigest()
    _write_synced(temporary / MANIFEST, json.dumps(manifest, indent=1).encode())
    for folder in {temporary, *(temporary / name for name in files)}:
        if folder.is_dir():
            _fsync_path(folder)
    _before_rename(temporary)
    if final.exists():  # the same step saved again (e.g. a stop right after a periodic save)
        shutil.rmtree(final)
    os.replace(temporary, final)
    _fsync_path(root)
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _before_rename(temporary: Path) -> None:
    """The moment between a complete temporary folder and its rename (tests stop a run here)."""


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Renamed (hence complete) checkpoint folders, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[5:].isdigit())


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Temporary folders a killed run left behind."""
    root = checkpoint_root(run_dir)
    for stale in root.glob(".tmp-*") if root.is_dir() else ():
        shutil.rmtree(stale, ignore_errors=True)


def read_checkpoint(folder: Path) -> dict[str, bytes]:
    """Every file the manifest names, checked against its SHA-256; a one-line error otherwise."""
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        raise QerlError(f"checkpoint {folder} is corrupt: cannot read {MANIFEST} ({error})") from None
    if not isinstance(manifest, dict) or not all(isinstance(v, str) for v in manifest.values()):
        raise QerlError(f"checkpoint {folder} is corrupt: {MANIFEST} is not a file -> SHA-256 table")
    missing = [name for name in REQUIRED if name not in manifest]
    if missing:
        raise QerlError(f"checkpoint {folder} is corrupt: {MANIFEST} does not list {', '.join(missing)}")
    files = {}
    for name, digest in manifest.items():
        path = folder / name
        try:
            data = path.read_bytes()
        except OSError as error:
            raise QerlError(f"checkpoint {folder} is corrupt: cannot read {name} ({error.strerror})") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise QerlError(f"checkpoint {folder} is corrupt: {name} does not match its checksum")
        files[name] = data
    return files


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run; a one-line error when there is none."""
    found = complete_checkpoints(run_dir)
    if not found:
        aside = Path(run_dir) / PREVIOUS_RUN  # an overwrite killed before its first checkpoint
        hint = f"; the run it overwrote is in {aside} (move its files back to resume that)" if aside.is_dir() else ""
        raise QerlError(f"{run_dir} has no checkpoint to resume from (looked in {checkpoint_root(run_dir)}){hint}")
    return found[-1]


def periodic_save_due(every: int, minutes: float, steps_done: int, seconds_since_save: float) -> bool:
    """checkpoint.every steps or checkpoint.minutes of wall time since the last save, whichever first."""
    return bool(every and steps_done % every == 0) or bool(minutes and seconds_since_save >= minutes * 60)


def newest_intact_checkpoint(run_dir: Path, log=print) -> tuple[Path, dict[str, bytes]]:
    """The newest complete checkpoint whose files verify, and its files; a corrupt newer one is
    passed over with a one-line note (the newest one's error when none is intact)."""
    latest_checkpoint(run_dir)  # a one-line error when there is none
    errors = []
    for folder in reversed(complete_checkpoints(run_dir)):
        try:
            return folder, read_checkpoint(folder)
        except QerlError as error:
            errors.append(error)
            log(f"[qerl] note: {error}; trying the one before")
    raise errors[0]


def steps_done(folder: Path) -> int:
    return int(folder.name.removeprefix(_PREFIX))

"""A week-long run's safety in the driver's own logic, without Ray or vLLM: a step with nothing to
train, run-folder lock, overwrite that keeps the previous run until the new one has proved
itself, resume inputs that are checked before anything starts. The Ray/vLLM parts these
decisions drive keep their own tests (test_resume, test_training)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from deploy.checkpoint import newest_intact_checkpoint, periodic_save_due, write_checkpoint
from deploy.cli import main
from deploy.rollouts import Group, score
from deploy.run_folder import (
    LOCK_FILE,
    PREVIOUS_RUN,
    RunLock,
    discard_previous_run,
    move_previous_run_aside,
    restore_previous_run,
)
from deploy.train import _keep_metrics_before, sync
from shared.config import load_config
from shared.errors import QerlError
from shared.metrics import format_step_line, read_resumable_metrics
from shared.scoring import Scorer
from shared.tasks import Problem
from shared.types import Completion

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class _PoolStandIn:
    """The rollout pool as `sync` sees it: which adapter version the workers hold, and pushes."""

    state: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(adapter_version=0))
    pushed: list[int] = field(default_factory=list)

    def update_adapter(self, update, version=None, wait=True) -> list[float]:
        self.pushed.append(version)
        self.state.adapter_version = version
        return [1.0]

    def load_times(self) -> list[float]:
        return [1.0]


class _LearnerStandIn:
    class export_adapter:  # noqa: N801 - mirrors a Ray actor method handle
        @staticmethod
        def remote():
            return "adapter"


def test_a_step_that_did_not_change_the_adapter_pushes_nothing():
    """Step 0 with nothing to train (or a skipped non-finite step) leaves the learner at version 0:
    pushing it made vLLM refuse lora id 0 and killed the run."""
    pool = _PoolStandIn()
    run = SimpleNamespace(pool=pool, learner=_LearnerStandIn(), config=load_config("configs/tiny_cpu.yaml"))
    assert sync(run, 0) == {"sync/adapter_ms": 0.0, "sync/worker_load_ms_max": 0.0}
    sync(run, 1)
    sync(run, 1)  # the next step trained nothing either
    assert pool.pushed == [1]


def test_the_step_line_of_a_step_with_nothing_to_train():
    record = {"step": 3, "rollout/reward_mean": 1.0, "rollout/accuracy": 1.0, "aqn/sigma": 0.0,
              "rollout/tok_per_s": 10.0, "sync/adapter_ms": 0.0, "time/step_s": 0.1}
    assert "nothing to train" in format_step_line(record)
    assert "entropy 0.500" in format_step_line(record | {"learner/entropy": 0.5, "mismatch/kl": 0.0})


def test_a_nan_reward_scores_zero_and_is_counted():
    class NanTask:
        def reward(self, problem, completion):
            return math.nan if completion == "nan" else 1.0

    def decode(ids, skip_special_tokens):
        return ["nan" if i == [1] else "ok" for i in ids]

    tokenizer = SimpleNamespace(batch_decode=decode)
    scorer = Scorer(NanTask().reward, threads=1)
    run = SimpleNamespace(config=load_config("configs/tiny_cpu.yaml"), tokenizer=tokenizer, scorer=scorer,
                          pool=SimpleNamespace(pump_once=lambda: None))
    completions = [Completion(0, [token], [0.0], "stop", 1, 0.0, 0) for token in (1, 2)]
    group = Group(Problem("1+1=", "2"), [5], completions)
    try:
        assert score(run, [group]).errors == 1
    finally:
        scorer.close()
    assert group.rewards == [0.0, 1.0]


def _hold_lock(run_dir) -> subprocess.Popen:
    """Another driver: a process that takes the run folder's lock and keeps it."""
    code = ("import sys, time; from deploy.run_folder import RunLock; RunLock(__import__('pathlib').Path(sys.argv[1]));"
            " print('locked', flush=True); time.sleep(300)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_driver_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(Path("configs/tiny_cpu.yaml").read_text())
    holder = _hold_lock(run_dir)
    try:
        overwrite = ["train", "--config", "configs/tiny_cpu.yaml", f"train.run_dir={run_dir}", "train.overwrite=true"]
        for args in (["train", "--resume", str(run_dir)], overwrite):
            assert main(args) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"in use by another qerl train (pid {holder.pid} on" in err[0], err
    finally:
        holder.kill()
        holder.wait()
    assert (run_dir / LOCK_FILE).read_text() == f"pid {holder.pid} on {socket.gethostname()}\n"  # SIGKILL left it
    RunLock(run_dir).release()  # the dead driver's lock is taken over
    assert not (run_dir / LOCK_FILE).exists()  # and a driver that ends cleanly leaves no trace


def _fake_run(run_dir: Path, tag: str) -> None:
    (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-000001" / "manifest.json").write_text(tag)
    (run_dir / "metrics.jsonl").write_text(tag)
    (run_dir / "final_adapter").mkdir()
    (run_dir / "config.yaml").write_text(tag)


def test_an_overwrite_that_fails_before_its_first_checkpoint_restores_the_previous_run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _fake_run(run_dir, "old")
    move_previous_run_aside(run_dir)
    assert not (run_dir / "metrics.jsonl").exists()
    (run_dir / "metrics.jsonl").write_text("new")  # the new run's first steps, then it fails
    (run_dir / "config.yaml").write_text("new")
    assert restore_previous_run(run_dir)
    assert (run_dir / "metrics.jsonl").read_text() == "old" and (run_dir / "config.yaml").read_text() == "old"
    assert (run_dir / "checkpoints" / "step-000001" / "manifest.json").read_text() == "old"
    assert not (run_dir / PREVIOUS_RUN).exists()


def test_an_overwrite_of_an_empty_folder_keeps_the_failed_runs_own_outputs(tmp_path):
    move_previous_run_aside(tmp_path)
    (tmp_path / "logs").mkdir()  # the failed run's actor logs: what tells the user why
    assert not restore_previous_run(tmp_path) and (tmp_path / "logs").is_dir()


def test_an_overwrite_killed_before_its_first_checkpoint_keeps_the_real_previous_run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _fake_run(run_dir, "old")
    move_previous_run_aside(run_dir)
    (run_dir / "metrics.jsonl").write_text("killed attempt")  # SIGKILLed: nothing restored it
    move_previous_run_aside(run_dir)  # the next overwrite
    assert (run_dir / PREVIOUS_RUN / "metrics.jsonl").read_text() == "old"
    assert not (run_dir / "metrics.jsonl").exists()
    discard_previous_run(run_dir)  # its first checkpoint
    assert not (run_dir / PREVIOUS_RUN).exists() and not restore_previous_run(run_dir)


def test_checkpoints_are_due_by_steps_or_by_minutes():
    assert periodic_save_due(every=50, minutes=0, steps_done=100, seconds_since_save=1.0)
    assert not periodic_save_due(every=50, minutes=0, steps_done=101, seconds_since_save=1e6)
    assert periodic_save_due(every=0, minutes=10, steps_done=7, seconds_since_save=600.0)
    assert not periodic_save_due(every=0, minutes=10, steps_done=7, seconds_since_save=599.0)
    assert not periodic_save_due(every=0, minutes=0, steps_done=100, seconds_since_save=1e6)


def test_every_shipped_config_checkpoints_periodically():
    """A SIGKILL loses at most checkpoint.every steps or checkpoint.minutes, the demo's too."""
    for path in sorted(ROOT.glob("configs/*.yaml")):
        checkpoint = load_config(path).checkpoint
        assert 0 < checkpoint.minutes <= 30 or checkpoint.every, path
    assert load_config(ROOT / "configs/tiny_cpu.yaml").checkpoint.every == 50  # the demo's 500 steps: 10 saves


def _checkpoint(run_dir: Path, steps: int, config_path: Path) -> Path:
    """A checkpoint as the driver writes it, with stand-in learner files (the resume checks below
    refuse before any learner reads them)."""
    from deploy.train import resolve_model_path, run_identity

    config = load_config(config_path)
    identity = run_identity(config, resolve_model_path(config.model.path, log=lambda *_: None))
    driver = {"steps_done": steps, "adapter_version": steps, "sigma": 0.0, "identity": identity,
              "sampler_state": [3, [0] * 625, None]}
    files = {"driver.json": json.dumps(driver).encode(), "learner_state.safetensors": b"x",
             "learner_state.json": b"{}", "adapter/adapter_config.json": b"{}"}
    return write_checkpoint(run_dir, steps, files, keep=5)


def _run_with_checkpoints(tmp_path: Path, steps: list[int]) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = Path("configs/tiny_cpu.yaml").read_text().replace("runs/tiny_cpu", str(run_dir))
    (run_dir / "config.yaml").write_text(config)
    for done in steps:
        _checkpoint(run_dir, done, run_dir / "config.yaml")
    return run_dir


def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(tiny_model, tmp_path):
    run_dir = _run_with_checkpoints(tmp_path, [2, 4])
    (run_dir / "checkpoints" / "step-000004" / "driver.json").write_text("{}")
    notes = []
    folder, files = newest_intact_checkpoint(run_dir, log=notes.append)
    assert folder.name == "step-000002" and json.loads(files["driver.json"])["steps_done"] == 2
    assert len(notes) == 1 and "step-000004 is corrupt: driver.json does not match its checksum" in notes[0]


@pytest.mark.parametrize("manifest", ["{}", "[]", '{"driver.json": 5}'])
def test_a_manifest_that_is_no_file_table_is_a_one_line_error(tiny_model, tmp_path, capsys, manifest):
    run_dir = _run_with_checkpoints(tmp_path, [2])
    (run_dir / "checkpoints" / "step-000002" / "manifest.json").write_text(manifest)
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step-000002 is corrupt: manifest.json" in err[0], err


def test_the_embedded_models_run_identity_does_not_hold_its_cache_path():
    from deploy.train import _saved_identity, run_identity

    config = load_config("configs/tiny_cpu.yaml")
    here = run_identity(config, "/root/.cache/qerl/tiny-qwen2-8285b915af5b")
    moved = run_identity(config, "/elsewhere/qerl/tiny-qwen2-8285b915af5b")
    assert here == moved and "/" not in here["model"]
    assert run_identity(config, "/elsewhere/qerl/tiny-qwen2-0000") != here  # another recipe, another model
    older = {**here, "model": "/old/cache/tiny-qwen2-8285b915af5b"}  # a checkpoint written before this change
    assert _saved_identity(older, config) == here


def test_resume_drops_a_torn_last_metrics_line_and_refuses_a_bad_middle_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1.0}\n{"step": 1, "a": 2.0}\n{"step": 2, "a"')
    assert read_resumable_metrics(path) == ([{"step": 0, "a": 1.0}, {"step": 1, "a": 2.0}], True)
    _keep_metrics_before(path, 1)
    assert path.read_text() == '{"step": 0, "a": 1.0}\n'
    path.write_text('{"step": 0}\n{"step": 1, "a\n{"step": 2}\n')
    with pytest.raises(QerlError, match=r"metrics.jsonl:2: not a metrics record"):
        read_resumable_metrics(path)


def test_resume_refuses_a_bad_metrics_line_before_any_engine_starts(tiny_model, tmp_path, capsys):
    run_dir = _run_with_checkpoints(tmp_path, [2])
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "a\n{"step": 2}\n')
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl:2: not a metrics record" in err[0], err


def test_resume_of_an_overwrite_killed_before_its_first_checkpoint_points_to_the_previous_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _fake_run(run_dir, "old")
    move_previous_run_aside(run_dir)  # then SIGKILLed: nothing restored it
    (run_dir / "config.yaml").write_text(Path("configs/tiny_cpu.yaml").read_text())
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the run it overwrote is in {run_dir / PREVIOUS_RUN}" in err[0], err

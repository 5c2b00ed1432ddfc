"""Checkpoint and resume with real processes: `qerl train` runs as a subprocess and is killed for
real (SIGKILL at a step boundary, SIGKILL in the middle of a checkpoint write, SIGINT/SIGTERM).

On CPU with fixed seeds a resumed run is the same run: the per-step rewards and the final
adapter are bit-identical to a straight run's. Everything random is either restored (the
learner's optimizer, schedule and torch RNG, the task sampler's RNG) or derived from the run
seed and the step (AQN noise, every prompt's sampling seed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file

from deploy.checkpoint import complete_checkpoints, read_checkpoint
from shared.metrics import read_metrics

pytestmark = pytest.mark.slow
STEPS = 6
ROOT = Path(__file__).resolve().parents[2]
SMALL_RUN = ["rollout.num_workers=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=5",
             "train.prompts_per_step=8", "checkpoint.every=1", "checkpoint.keep=10", "learner.warmup_steps=2",
             "lora.rank=8", "lora.alpha=16", "train.eval_every=3", "train.eval_problems=16"]
# Run inside the subprocess: optionally hold a checkpoint write between its complete temporary
# folder and the rename (writing a marker file first), then run the qerl CLI.
LAUNCHER = """
import sys, time, pathlib
import deploy.checkpoint as checkpoint
marker, hold = sys.argv[1], sys.argv[2]
if hold:
    def _hold(temporary):
        if hold in temporary.name:
            pathlib.Path(marker).write_text(str(temporary))
            time.sleep(600)
    checkpoint._before_rename = _hold
from deploy.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _start(args: list[str], marker: str, env: dict, hold: str = "") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, marker, hold, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _env(tag: str) -> dict:
    return {**os.environ, "QERL_TEST_RUN": tag, "PYTHONPATH": str(ROOT)}


def _train(run_dir: Path, extra: list[str] = ()) -> list[str]:
    return ["train", "--config", "configs/tiny_cpu.yaml", f"train.steps={STEPS}", f"train.run_dir={run_dir}",
            *SMALL_RUN, *extra]


def _wait_for(condition, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"qerl exited early ({process.returncode}):\n{process.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.05)


def _finish(process: subprocess.Popen, timeout: float = 300) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-3000:]
    return output


def _processes_tagged(tag: str) -> list[int]:
    """Live processes that inherited the test run's environment marker (Ray, workers, engines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"QERL_TEST_RUN={tag}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _rewards(run_dir: Path) -> list[float]:
    return [r["rollout/reward_mean"] for r in read_metrics(run_dir / "metrics.jsonl")]


def _adapter(run_dir: Path) -> dict:
    return load_file(str(run_dir / "final_adapter" / "adapter_model.safetensors"))


def _assert_same_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differing = [name for name in a if not (a[name] == b[name]).all()]
    assert differing == [], f"{len(differing)} adapter tensors differ, e.g. {differing[:2]}"


@pytest.fixture(scope="module")
def straight_run(tiny_model, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    output = _finish(_start(_train(run_dir), "", _env(uuid.uuid4().hex)))
    (run_dir.parent / "console.txt").write_text(output)
    return run_dir


def test_the_console_shows_qerl_lines_and_the_actors_log_to_the_run_folder(straight_run):
    console = (straight_run.parent / "console.txt").read_text().splitlines()
    chatter = [line for line in console if not line.startswith(("[qerl]", "step "))]
    assert chatter == []
    assert sum(line.startswith("step ") for line in console) == STEPS
    logs = {p.name for p in (straight_run / "logs").iterdir()}
    assert logs == {"learner.log", "rollout-worker-0.log", "rollout-worker-1.log"}
    assert (straight_run / "logs" / "rollout-worker-0.log").stat().st_size > 0


def test_sigkill_then_resume_is_the_straight_run(straight_run, tmp_path):
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    process = _start(_train(run_dir), "", _env(tag))
    _wait_for(lambda: (run_dir / "checkpoints" / "step-000003").is_dir(), process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(complete_checkpoints(run_dir)) == 3
    output = _finish(_start(["train", "--resume", str(run_dir)], "", _env(tag)))
    assert "resuming" in output and "from step-000003" in output
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(STEPS))
    assert _rewards(run_dir) == _rewards(straight_run)  # bit-exact
    _assert_same_adapter(_adapter(run_dir), _adapter(straight_run))
    evals = {r["step"]: r["eval/accuracy"] for r in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in r}
    straight_evals = {r["step"]: r["eval/accuracy"] for r in read_metrics(straight_run / "metrics.jsonl")
                      if "eval/accuracy" in r}
    assert evals == straight_evals and sorted(evals) == [2, 5]  # train.eval_every=3, held-out problems
    # the checkpoint is a standard peft folder and records where the run stood
    files = read_checkpoint(complete_checkpoints(run_dir)[-1])
    assert json.loads(files["driver.json"])["steps_done"] == STEPS
    assert json.loads(files["adapter/adapter_config.json"])["r"] == 8


def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_one(straight_run, tmp_path):
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    marker = tmp_path / "holding"
    process = _start(_train(run_dir), str(marker), _env(tag), hold="step-000004")
    _wait_for(marker.exists, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    partial = Path(marker.read_text())
    assert partial.is_dir() and (partial / "manifest.json").exists()  # complete, but never renamed
    assert [p.name for p in complete_checkpoints(run_dir)][-1] == "step-000003"
    read_checkpoint(complete_checkpoints(run_dir)[-1])  # loadable
    output = _finish(_start(["train", "--resume", str(run_dir)], "", _env(tag)))
    assert "from step-000003" in output
    assert not partial.exists()  # the stale temporary folder is cleaned up
    assert _rewards(run_dir) == _rewards(straight_run)
    _assert_same_adapter(_adapter(run_dir), _adapter(straight_run))


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_with_a_checkpoint_and_leaves_nothing_behind(tiny_model, tmp_path, signal_number):
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    shm_before = set(os.listdir("/dev/shm"))
    process = _start(_train(run_dir, ["train.steps=200", "checkpoint.every=0"]), "", _env(tag))
    _wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir / "metrics.jsonl")) >= 2,
              process)
    signalled = time.monotonic()
    process.send_signal(signal_number)
    output, _ = process.communicate(timeout=60)
    stopped_after = time.monotonic() - signalled
    assert process.returncode == 128 + signal_number, output[-3000:]
    assert stopped_after < 20, f"took {stopped_after:.1f} s to stop"
    assert f"qerl train --resume {run_dir}" in output
    done = len(read_metrics(run_dir / "metrics.jsonl"))
    assert [p.name for p in complete_checkpoints(run_dir)] == [f"step-{done:06d}"]
    deadline = time.monotonic() + 15  # Ray's processes exit right after the driver
    while _processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_tagged(tag) == []
    assert set(os.listdir("/dev/shm")) - shm_before == set()


def test_non_finite_steps_are_skipped_then_stop_the_run(tiny_model, tmp_path):
    """Every advantage NaN from step 2 on (injected in the subprocess): each step skips its
    optimizer step; after learner.max_bad_steps in a row the run stops with exit 2, and the
    last good checkpoint (after step 1) is the newest one."""
    run_dir = tmp_path / "run"
    poison = """
import sys, math
import deploy.train as train
original = train.training_samples
def poisoned(groups, n, *rest):
    samples = original(groups, n, *rest)
    if train._poison_step[0] >= 2:
        samples = [s.__class__(s.prompt_ids, s.completion_ids, s.rollout_logprobs, math.nan) for s in samples]
    train._poison_step[0] += 1
    return samples
train._poison_step = [0]
train.training_samples = poisoned
from deploy.cli import main
sys.exit(main(sys.argv[1:]))
"""
    args = _train(run_dir, ["learner.max_bad_steps=2"])
    result = subprocess.run([sys.executable, "-c", poison, *args], cwd=ROOT, env=_env(uuid.uuid4().hex),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert "non-finite loss or gradients in 2 steps in a row" in error and "step-000002" in error
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["learner/skipped_steps"] for r in records] == [0, 0, 1, 1]
    assert records[2]["adapter/version"] == records[3]["adapter/version"] == 2  # no update reached the workers
    assert [p.name for p in complete_checkpoints(run_dir)][-1] == "step-000002"


def _resume_error(run_dir: Path, *overrides: str) -> str:
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "--resume", str(run_dir), *overrides],
                            cwd=ROOT, env=_env(uuid.uuid4().hex), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qerl: error: "), result.stderr[-2000:]
    return lines[0]


def _copy_run(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_bad_input_is_one_line_and_deletes_nothing(straight_run, tmp_path):
    # a folder with a run config but no checkpoint
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((straight_run / "config.yaml").read_text())
    assert "has no checkpoint to resume from" in _resume_error(empty)
    # no run at all
    assert "holds no run to resume" in _resume_error(tmp_path / "nothing")
    # a checkpoint from a run with another LoRA rank than the folder's config
    other = _copy_run(straight_run, tmp_path / "other")
    config = (other / "config.yaml").read_text().replace("rank: 8", "rank: 4")
    (other / "config.yaml").write_text(config)
    assert "belongs to another run (lora_rank differ" in _resume_error(other, "train.steps=9")
    # an override that would change what the run is
    assert "learner.lr would change the run's meaning" in _resume_error(straight_run, "learner.lr=0.1")
    # the run already did its steps
    assert "already ran its 6 steps" in _resume_error(straight_run)
    # a corrupt checkpoint file in every checkpoint (a corrupt newest alone falls back to the one
    # before): named, and nothing is deleted or rewritten
    corrupt = _copy_run(straight_run, tmp_path / "corrupt")
    for checkpoint in complete_checkpoints(corrupt):
        state = checkpoint / "learner_state.safetensors"
        state.write_bytes(state.read_bytes()[:-7] + b"garbage")
    before = _listing(corrupt)
    error = _resume_error(corrupt, "train.steps=9")
    assert "is corrupt: learner_state.safetensors does not match its checksum" in error
    assert _listing(corrupt) == before

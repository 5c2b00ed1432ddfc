"""`qerl` on bad input: one line naming the problem, a non-zero exit, earlier outputs untouched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _qerl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _assert_one_line_error(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qerl: error: "), result.stderr
    assert expected in lines[0]


def test_unknown_config_key(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("rollout:\n  num_wrokers: 2\n")
    _assert_one_line_error(_qerl("train", "--config", str(config)), "rollout.num_wrokers: Extra inputs are not permitted")


def test_wrong_type_override():
    _assert_one_line_error(
        _qerl("train", "--config", "configs/tiny_cpu.yaml", "train.steps=lots"), "train.steps: Input should be a valid integer"
    )


def test_missing_model_path(tmp_path):
    result = _qerl("train", "--config", "configs/tiny_cpu.yaml", f"model.path={tmp_path / 'nope'}",
                   f"train.run_dir={tmp_path / 'run'}")
    _assert_one_line_error(result, "is not a Hugging Face model folder")


def test_malformed_dataset_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1=", "answer": "#### 2"}\n{"question": "2+2=", "answer": \n')
    result = _qerl("train", "--config", "configs/tiny_cpu.yaml", "task.name=jsonl", f"task.path={data}",
                   f"train.run_dir={tmp_path / 'run'}")
    _assert_one_line_error(result, "data.jsonl:2: not valid JSON")


def test_existing_run_is_not_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    result = _qerl("train", "--config", "configs/tiny_cpu.yaml", f"train.run_dir={run_dir}")
    _assert_one_line_error(result, "already holds a run")
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n'


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]])
def test_help(args):
    result = _qerl(*args)
    assert result.returncode == 0 and "usage: qerl" in result.stdout


@pytest.mark.parametrize("args, expected", [
    (["bench", "sync", "--repeats", "0"], "qerl bench sync: error: argument --repeats: expected an integer >= 1, got 0"),
    (["bench", "rollout", "--concurrency", "16,x"], "qerl bench rollout: error: argument --concurrency: expected"),
    (["train"], "qerl train: error: the following arguments are required: --config"),
    (["bench", "rollout", "--profile", "README.md"],
     "qerl bench rollout: error: argument --profile: README.md is a file, not a folder"),
    (["bench", "rollout", "--lora-kernel-configs", "/no/such/qerl-folder"],
     "qerl bench rollout: error: argument --lora-kernel-configs: no such folder: /no/such/qerl-folder"),
])
def test_bad_arguments_are_one_line_errors(args, expected):
    result = _qerl(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr

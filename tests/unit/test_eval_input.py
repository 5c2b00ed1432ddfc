"""Evaluation without an engine: the held-out split training never samples, and `qerl eval` on
bad input is one line, exit 2."""

from __future__ import annotations

import json
from random import Random

import pytest

from deploy.cli import main
from shared.tasks.addition import AdditionTask, is_held_out


def test_training_never_samples_a_held_out_problem():
    task = AdditionTask(digits=2)
    sampled = {p.prompt for p in task.sample(Random(0), 5000)}
    held_out = task.held_out(64)
    assert len({p.prompt for p in held_out}) == 64 and held_out == task.held_out(64)  # distinct, fixed
    assert all(is_held_out(*map(int, p.prompt.rstrip("=").split("+"))) for p in held_out)
    assert sampled.isdisjoint(p.prompt for p in held_out)
    assert len(sampled) > 1000  # the training split is most of the pairs


def test_eval_bad_input_is_one_line(tmp_path, capsys):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    cases = [
        (["eval", "--config", "configs/tiny_cpu.yaml", "--adapter", str(pickled)], "pickle file"),
        (["eval", "--config", "configs/tiny_cpu.yaml", "--adapter", str(tmp_path)], "not a peft adapter folder"),
        (["eval", str(tmp_path / "nothing")], "holds no run"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], lines
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--config", "configs/tiny_cpu.yaml"])
    assert exit_info.value.code == 2
    assert "needs --adapter" in capsys.readouterr().err

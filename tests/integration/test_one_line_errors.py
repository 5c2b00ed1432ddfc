"""Inputs that used to end in a traceback (issue 24, item 8): each is now one line naming the
problem and exit code 2, before anything starts. In process, through the CLI's `main`."""

from __future__ import annotations

import json

import pytest

from deploy.cli import main


def _one_line_error(capsys, args: list[str], expected: str) -> None:
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("qerl: error: "), err
    assert expected in err[0], err[0]


@pytest.mark.parametrize("reward", ['"high"', "null"])
def test_report_on_a_reward_that_is_not_a_number(tmp_path, capsys, reward):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(f'{{"step": 0, "rollout/reward_mean": {reward}}}\n'
                                       '{"step": 1, "rollout/reward_mean": 0.5}\n')
    assert main(["report", str(run)]) == 0
    assert "reward first step 0.500 -> last step 0.500" in capsys.readouterr().out


def test_report_out_under_a_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "rollout/reward_mean": 0.5}\n')
    (tmp_path / "file").write_text("")
    _one_line_error(capsys, ["report", str(run), "--out", str(tmp_path / "file" / "x.png")],
                    "(a file is in the way)")


def test_train_run_dir_under_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    _one_line_error(capsys, ["train", "--config", "configs/tiny_cpu.yaml", f"train.run_dir={tmp_path}/file/sub"],
                    "cannot be created: Not a directory")


def test_a_prompt_template_with_an_attribute_of_the_question(capsys):
    _one_line_error(capsys, ["train", "--config", "configs/tiny_cpu.yaml", 'task.prompt_template="Q: {question.x}"'],
                    "may name only {question}")


@pytest.mark.parametrize(("answer", "expected"), [("9" * 5000, "Exceeds the limit (4300 digits)"),
                                                  ("[" * 100_000 + "]" * 100_000, "nested too deep")])
def test_dataset_lines_json_cannot_hold(tmp_path, capsys, answer, expected):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "answer": "#### 2"}) + "\n"
                    f'{{"question": "2+2=", "answer": {answer}}}\n')
    _one_line_error(capsys, ["train", "--config", "configs/tiny_cpu.yaml", "task.name=jsonl", f"task.path={data}",
                             f"train.run_dir={tmp_path / 'run'}"], f"data.jsonl:2: not usable JSON ({expected}")


def test_a_max_model_len_beyond_the_models_context(tiny_model, tmp_path, capsys):
    _one_line_error(capsys, ["train", "--config", "configs/tiny_cpu.yaml", "rollout.max_model_len=4096",
                             f"train.run_dir={tmp_path / 'run'}"],
                    "rollout.max_model_len 4096 is more than the model's context (max_position_embeddings 256")
    assert not (tmp_path / "run" / "config.yaml").exists()

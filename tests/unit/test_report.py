"""`qerl report`: the PNG of two runs' curves, the summary lines, and one-line errors that leave
an earlier report.png alone. In process, through the CLI's `main`; no GPU, no Ray, no model."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.report import load_run, write_report
from shared.errors import QerlError
from shared.metrics import TensorBoardWriter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir: Path, steps: int, reward, evals: bool, kl: float) -> Path:
    """A metrics.jsonl as training writes it: every key each step, eval keys every 5th step."""
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(steps):
        record = {
            "step": step,
            "rollout/reward_mean": reward(step),
            "rollout/accuracy": reward(step),
            "rollout/tok_per_s": 1000.0 + 2 * step,
            "learner/entropy": 0.6 - step / 200,
            "mismatch/kl": kl / (step + 1),
            "aqn/sigma": 0.0 if step < 3 else 1e-2 * 0.9**step,  # 0 before the first noise stage
            "time/step_s": 2.0 if evals else 0.5,
            "learner/step_ms": 300.0,
        }
        if evals and step % 5 == 0:
            record |= {"eval/accuracy": step / 50, "eval/pass_at_k": min(1.0, step / 25)}
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


@pytest.fixture
def runs(tmp_path) -> tuple[Path, Path]:
    # rewards are multiples of 1/128, so the window means are exact in binary:
    # a, 40 steps, window 4: mean(0..3)/64 = 0.0234375 -> mean(36..39)/64 = 0.5859375
    # b, 20 steps, window 2: 0.5 - mean(0, 1)/128 = 0.49609375 -> 0.5 - mean(18, 19)/128 = 0.35546875
    a = _write_run(tmp_path / "runs" / "a", 40, lambda step: step / 64, evals=True, kl=1e-4)
    b = _write_run(tmp_path / "runs" / "b", 20, lambda step: 0.5 - step / 128, evals=False, kl=0.0)
    return a, b


def _qerl(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own exits
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def _assert_one_line_error(result: tuple[int, str, str], expected: str) -> None:
    code, _, err = result
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qerl: error: "), err
    assert expected in lines[0], lines[0]


def test_two_runs_overlaid_with_summary(runs, tmp_path, capsys):
    a, b = runs
    png = tmp_path / "cmp.png"
    code, out, err = _qerl(capsys, "report", str(a), str(b), "--out", str(png))
    assert code == 0, err
    width, height = _png_size(png)
    assert width > 500 and height > 500 and png.stat().st_size > 20_000
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    lines = out.strip().splitlines()
    assert lines[0] == ("[qerl] a: 40 steps | reward first 4 steps 0.023 -> last 4 steps 0.586"
                        " | eval acc 0.700 (step 35) | median step 2.00 s | median 1,039 tok/s")
    assert lines[1] == ("[qerl] b: 20 steps | reward first 2 steps 0.496 -> last 2 steps 0.355"
                        " | no eval | median step 0.50 s | median 1,019 tok/s")
    assert lines[2] == f"[qerl] report: {png}"
    assert not (a / "report.png").exists()


def test_default_out_is_the_first_run_folder(runs, capsys):
    a, _ = runs
    code, out, err = _qerl(capsys, "report", str(a))
    assert code == 0, err
    assert out.strip().splitlines()[-1] == f"[qerl] report: {a / 'report.png'}"
    assert _png_size(a / "report.png")[0] > 500


def test_runs_sharing_a_folder_name_are_labelled_by_path(tmp_path, capsys):
    first = _write_run(tmp_path / "seed1" / "tiny", 10, lambda step: step / 64, evals=False, kl=1e-4)
    second = _write_run(tmp_path / "seed2" / "tiny", 10, lambda step: step / 32, evals=False, kl=1e-4)
    code, out, err = _qerl(capsys, "report", str(first), str(second), "--out", str(tmp_path / "r.png"))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"[qerl] {first}: 10 steps") and lines[1].startswith(f"[qerl] {second}: 10 steps")


def test_load_run_reads_records_and_labels_by_folder(runs):
    a, _ = runs
    run = load_run(a)
    assert run.label == "a" and len(run.records) == 40 and run.records[5]["eval/accuracy"] == 0.1


@pytest.mark.parametrize("setup, expected", [
    ("missing", "no such run folder"),
    ("empty_folder", "no metrics.jsonl"),
    ("corrupt_line", "metrics.jsonl:3: not valid JSON"),
    ("not_a_record", "metrics.jsonl:2: not a metrics record"),
    ("no_steps", "metrics.jsonl: no steps recorded"),
])
def test_bad_run_folders_are_one_line_errors_and_keep_the_old_report(setup, expected, runs, capsys):
    a, _ = runs
    bad = a.parent / "bad"
    if setup != "missing":
        bad.mkdir()
    if setup == "corrupt_line":  # a run killed mid-write: the last line is cut short
        lines = (a / "metrics.jsonl").read_text().splitlines()[:2] + ['{"step": 2, "rollout/rew']
        (bad / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    elif setup == "not_a_record":
        (bad / "metrics.jsonl").write_text('{"step": 0}\n[1, 2]\n')
    elif setup == "no_steps":
        (bad / "metrics.jsonl").write_text("\n\n")
    (a / "report.png").write_bytes(b"the earlier report")
    _assert_one_line_error(_qerl(capsys, "report", str(a), str(bad)), expected)
    assert (a / "report.png").read_bytes() == b"the earlier report"
    assert sorted(p.name for p in a.iterdir()) == ["metrics.jsonl", "report.png"]


def test_a_crash_while_saving_leaves_no_half_png(runs, monkeypatch):
    a, _ = runs
    (a / "report.png").write_bytes(b"the earlier report")
    from matplotlib.figure import Figure

    def half_then_crash(self, file, **kwargs):
        file.write(PNG_SIGNATURE + b"half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        write_report([a])
    assert (a / "report.png").read_bytes() == b"the earlier report"
    assert sorted(p.name for p in a.iterdir()) == ["metrics.jsonl", "report.png"]


def test_report_takes_no_overrides(runs, tmp_path, capsys):
    a, _ = runs
    code, _, err = _qerl(capsys, "report", str(a), "--out", str(tmp_path / "r.png"), "train.steps=3")
    assert code == 2 and err.strip() == (
        "qerl: error: report takes no section.key=value overrides: train.steps=3 (see qerl --help)")
    assert not (tmp_path / "r.png").exists()


def test_tensorboard_writer_or_its_install_hint(tmp_path):
    """Whichever applies here: without the package, the one-line hint; with it, the scalars."""
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(QerlError) as error:
            TensorBoardWriter(tmp_path / "tb")
        assert str(error.value) == (
            "train.tensorboard: the tensorboard package is not installed (pip install 'qerl[tensorboard]')")
        assert not (tmp_path / "tb").exists()
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(tmp_path / "tb")
    for step in range(3):
        writer.write({"step": step, "rollout/reward_mean": step / 4, "adapter/version": step, "note": "x",
                      "flag": True})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["adapter/version", "rollout/reward_mean"]
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")] == [(0, 0.0), (1, 0.25), (2, 0.5)]

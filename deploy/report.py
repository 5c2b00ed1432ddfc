"""`qerl report`: one PNG of a run's curves (several runs overlaid) and a summary line per run,
read from the runs' metrics.jsonl only (no config, no Ray, no model)."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from shared.errors import QerlError, read_utf8
from shared.metrics import reward_trend, steps_phrase

# (metric key, panel title, y scale): "log" drops values <= 0 (a log axis cannot show them),
# "log-if-positive" is log when the runs have positive values (AQN sigma is 0 outside its stages).
_PANELS = [
    ("rollout/reward_mean", "reward (rollout mean)", "linear"),
    ("eval/accuracy", "eval accuracy", "linear"),
    ("learner/entropy", "entropy (learner)", "linear"),
    ("mismatch/kl", "KL(rollout||learner)", "log"),
    ("aqn/sigma", "AQN sigma", "log-if-positive"),
    ("rollout/tok_per_s", "rollout tok/s", "linear"),
    ("time/step_s", "step time (s)", "linear"),
]
_SPARSE = {"eval/accuracy"}  # logged on evaluation steps only: markers, not one line through gaps


@dataclass(frozen=True)
class RunCurves:
    label: str  # the folder name; its path where two runs share a name
    records: list[dict]
    run_dir: Path


def load_run(run_dir: Path) -> RunCurves:
    """The run's metrics records; a QerlError naming the folder, file or line that is wrong."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise QerlError(f"{run_dir}: no such run folder")
    if not run_dir.is_dir():
        raise QerlError(f"{run_dir} is a file, not a run folder")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise QerlError(f"{run_dir}: no metrics.jsonl in this folder (is it a training run folder?)")
    records = []
    # parsed here rather than with read_metrics so a bad line (a run killed mid-write) is named
    for number, line in enumerate(read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise QerlError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or isinstance(record["step"], bool):
            raise QerlError(f"{path}:{number}: not a metrics record (a JSON object with an integer \"step\")")
        records.append(record)
    if not records:
        raise QerlError(f"{path}: no steps recorded")
    # "." or "runs/a/" still get the folder's real name
    return RunCurves(label=run_dir.resolve().name or str(run_dir), records=records, run_dir=run_dir)


def _load_runs(run_dirs: list[Path]) -> list[RunCurves]:
    """Every run loaded before anything is written, so a bad one leaves the old PNG alone."""
    runs = [load_run(Path(run_dir)) for run_dir in run_dirs]
    counts = Counter(run.label for run in runs)
    # runs/seed1/tiny_cpu vs runs/seed2/tiny_cpu: the legend needs the paths to tell them apart
    return [replace(run, label=str(run.run_dir)) if counts[run.label] > 1 else run for run in runs]


def _curve(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [step for step, _ in points], [value for _, value in points]


def _plot(runs: list[RunCurves], out: Path) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise QerlError("qerl report needs matplotlib (pip install 'matplotlib>=3.8')") from None
    matplotlib.use("Agg")  # before pyplot: renders to a file, works with no display
    import matplotlib.pyplot as plt

    if out.is_dir():
        raise QerlError(f"--out: {out} is a folder, not a PNG file")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # e.g. a file where a folder of the path should be
        why = "a file is in the way" if isinstance(error, (FileExistsError, NotADirectoryError)) else error.strerror
        raise QerlError(f"--out: cannot create the folder {out.parent} ({why})") from None
    fig, axes = plt.subplots(4, 2, figsize=(12, 13), dpi=100)
    try:
        colors = {run.label: f"C{index % 10}" for index, run in enumerate(runs)}  # one color per run in every panel
        all_steps = [r["step"] for run in runs for r in run.records]
        first, last = min(all_steps), max(all_steps)
        span = (first, last) if first < last else (first - 1, last + 1)  # a one-step run still gets an axis
        for ax, (key, title, scale) in zip(axes.flat, _PANELS):
            ax.set_title(title)
            ax.set_xlabel("step")
            curves = {run.label: _curve(run.records, key) for run in runs}
            positive = any(v > 0 for _, values in curves.values() for v in values)
            log = scale == "log" or (scale == "log-if-positive" and positive)
            logged = any(values for _, values in curves.values())
            drawn = False
            for label, (steps, values) in curves.items():
                if log:
                    steps = [s for s, v in zip(steps, values) if v > 0]
                    values = [v for v in values if v > 0]
                if not values:
                    continue
                style = {"marker": "o", "markersize": 4} if key in _SPARSE else {"linewidth": 1.2}
                ax.plot(steps, values, color=colors[label], label=label, **style)
                drawn = True
            if drawn and log:
                ax.set_yscale("log")
            if not drawn:
                note = "no eval" if key in _SPARSE else ("no positive values" if logged else "not logged")
                ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_xlim(*span)  # one step axis in every panel, also where a curve starts late (sigma 0)
            ax.grid(True, alpha=0.3)
        # the spare eighth cell holds the one legend for all panels
        legend_ax = axes.flat[len(_PANELS)]
        legend_ax.axis("off")
        handles = [plt.Line2D([], [], color=colors[run.label], linewidth=2) for run in runs]
        legend_ax.legend(handles, [run.label for run in runs], loc="center", title="runs", frameon=False)
        # the legend names every run; past a few, a joined title runs off the figure
        names = ", ".join(run.label for run in runs) if len(runs) <= 4 else f"{len(runs)} runs"
        fig.suptitle("qerl report: " + names)
        fig.tight_layout()
        # a crash mid-save leaves the temp file, never a half PNG at `out` (os.replace is atomic
        # within one folder); opened normally so the PNG gets the usual umask permissions
        temp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            with temp.open("wb") as file:
                fig.savefig(file, format="png")
            os.replace(temp, out)
        finally:
            temp.unlink(missing_ok=True)
    finally:
        plt.close(fig)  # pyplot keeps every figure alive until closed
    return out


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """The runs' curves as one PNG (default: <first run dir>/report.png); returns its path."""
    runs = _load_runs(run_dirs)
    return _plot(runs, Path(out) if out is not None else runs[0].run_dir / "report.png")


def summary_lines(runs: list[RunCurves]) -> list[str]:
    """Per run: steps, reward first tenth -> last tenth (as at the end of training), the last
    eval accuracy, median step time and rollout throughput (medians: robust to warm-up steps)."""
    lines = []
    for run in runs:
        rewarded = [r for r in run.records if isinstance(r.get("rollout/reward_mean"), (int, float))
                    and not isinstance(r["rollout/reward_mean"], bool) and math.isfinite(r["rollout/reward_mean"])]
        if rewarded:
            window, first, last = reward_trend(rewarded)
            steps = steps_phrase(window)
            reward = f"reward first {steps} {first:.3f} -> last {steps} {last:.3f}"
        else:
            reward = "no reward logged"
        eval_steps, eval_values = _curve(run.records, "eval/accuracy")
        evals = f"eval acc {eval_values[-1]:.3f} (step {eval_steps[-1]})" if eval_values else "no eval"
        step_s, tok_s = _curve(run.records, "time/step_s")[1], _curve(run.records, "rollout/tok_per_s")[1]
        step_time = f"median step {statistics.median(step_s):.2f} s" if step_s else "no step time"
        rate = f"median {statistics.median(tok_s):,.0f} tok/s" if tok_s else "no tok/s"
        lines.append(f"[qerl] {run.label}: {len(run.records)} steps | {reward} | {evals} | {step_time} | {rate}")
    return lines


def report(run_dirs: list[Path], out: Path | None = None, log: Callable[[str], object] = print) -> Path:
    """`qerl report`: load every run, write the PNG, log one summary line per run and its path."""
    runs = _load_runs(run_dirs)
    path = _plot(runs, Path(out) if out is not None else runs[0].run_dir / "report.png")
    for line in summary_lines(runs):
        log(line)
    log(f"[qerl] report: {path}")
    return path

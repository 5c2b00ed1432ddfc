"""Metrics: flat dicts with namespaced keys, one JSON line per step, one readable line per step."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from shared.errors import QerlError


class MetricsWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_resumable_metrics(path: Path) -> tuple[list[dict], bool]:
    """A run's metrics records for --resume, and whether the last line was torn (an interrupted
    write: dropped). Any other line that is not a metrics record is a one-line error."""
    if not path.exists():
        return [], False
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a metrics record")
        except ValueError as error:
            if number == len(lines):
                return records, True
            raise QerlError(f"{path}:{number}: not a metrics record ({error}); fix or remove that line") from None
        records.append(record)
    return records, False


def format_step_line(record: dict) -> str:
    # a step with nothing to train (dynamic sampling kept no group) has no learner metrics
    learner = (f" | entropy {record['learner/entropy']:.3f} | kl(rollout||learner) {record['mismatch/kl']:.2e}"
               if "learner/entropy" in record else " | nothing to train")
    return (
        f"step {record['step']:>4} | reward {record['rollout/reward_mean']:.3f}"
        f" | acc {record['rollout/accuracy']:.3f}"
        f"{learner}"
        f" | sigma {record['aqn/sigma']:.1e}"
        f" | {record['rollout/tok_per_s']:,.0f} tok/s"
        f" | sync {record['sync/adapter_ms']:.1f} ms"
        f" | {record['time/step_s']:.2f} s"
    )


def reward_trend(records: list[dict]) -> tuple[int, float, float]:
    """(window, mean reward of the first `window` steps, of the last): window = a tenth, at least 1.
    One definition for the end-of-training line and `qerl report`, so their figures agree."""
    window = max(1, len(records) // 10)
    first = sum(r["rollout/reward_mean"] for r in records[:window]) / window
    last = sum(r["rollout/reward_mean"] for r in records[-window:]) / window
    return window, first, last


def reward_trend_line(records: list[dict]) -> str:
    """Mean reward over the first and the last tenth of the steps: did it learn?"""
    window, first, last = reward_trend(records)
    steps = steps_phrase(window)
    return f"[qerl] mean reward, first {steps}: {first:.3f} -> last {steps}: {last:.3f}"


def steps_phrase(count: int) -> str:
    """"step" or "N steps", as in "the first step" / "the first 50 steps"."""
    return "step" if count == 1 else f"{count} steps"


def check_tensorboard() -> None:
    """torch.utils.tensorboard imports the tensorboard package itself; check first so a missing
    extra is a one-line QerlError (before any engine starts), not torch's ImportError traceback."""
    if importlib.util.find_spec("tensorboard") is None:
        raise QerlError("train.tensorboard: the tensorboard package is not installed (pip install 'qerl[tensorboard]')")


class TensorBoardWriter:
    """The same records as TensorBoard scalars (optional: the `tensorboard` extra), one per
    numeric metric at x = record["step"]; the key's namespace becomes TensorBoard's tag group."""

    def __init__(self, log_dir: str | Path):
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            # bools are ints to Python but flags, not curves; strings and lists are not scalars
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.close()

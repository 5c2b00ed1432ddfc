"""Metrics: flat dicts with namespaced keys, one JSON line per step, one readable line per step."""

from __future__ import annotations

import json
from pathlib import Path


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


def format_step_line(record: dict) -> str:
    return (
        f"step {record['step']:>4} | reward {record['rollout/reward_mean']:.3f}"
        f" | acc {record['rollout/accuracy']:.3f}"
        f" | entropy {record['learner/entropy']:.3f}"
        f" | kl(rollout||learner) {record['mismatch/kl']:.2e}"
        f" | sigma {record['aqn/sigma']:.1e}"
        f" | {record['rollout/tok_per_s']:,.0f} tok/s"
        f" | sync {record['sync/adapter_ms']:.1f} ms"
        f" | {record['time/step_s']:.2f} s"
    )


def reward_trend_line(records: list[dict]) -> str:
    """Mean reward over the first and the last tenth of the steps: did it learn?"""
    window = max(1, len(records) // 10)
    first = sum(r["rollout/reward_mean"] for r in records[:window]) / window
    last = sum(r["rollout/reward_mean"] for r in records[-window:]) / window
    return f"[qerl] mean reward, first {window} steps: {first:.3f} -> last {window} steps: {last:.3f}"

"""How far a stopped-and-resumed run is from one that never stopped, and from a second straight
run (run-to-run noise), on the embedded tiny model. The README's figure for asynchronous resume
comes from:

    python -m benchmarks.resume_drift --staleness 1 --out /tmp/resume_drift

Each run is `qerl train` as a subprocess; the stopped one gets SIGINT once its checkpoint after
`--stop-after` steps exists (it stops after the current step with a checkpoint) and is then
continued with `qerl train --resume`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["rollout.num_workers=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=5",
         "train.prompts_per_step=8", "checkpoint.every=1", "checkpoint.keep=20", "learner.warmup_steps=2",
         "lora.rank=8", "lora.alpha=16", "train.eval_every=0"]


def _command(run_dir: Path, steps: int, staleness: int) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", "train", "--config", "configs/tiny_cpu.yaml", *SMALL,
            f"train.steps={steps}", f"rollout.max_staleness={staleness}", f"train.run_dir={run_dir}"]


def _run(command: list[str]) -> None:
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[3:])} failed:\n{result.stderr[-2000:]}")


def _stopped_then_resumed(run_dir: Path, steps: int, staleness: int, stop_after: int) -> int:
    process = subprocess.Popen(_command(run_dir, steps, staleness), cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    marker = run_dir / "checkpoints" / f"step-{stop_after:06d}"
    while not marker.is_dir():
        if process.poll() is not None:
            raise SystemExit(f"the run ended before step {stop_after}: {process.stderr.read()[-2000:]}")
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    process.wait()
    stopped_at = len([line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()])
    _run([sys.executable, "-m", "deploy.cli", "train", "--resume", str(run_dir)])
    return stopped_at


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _adapter_gap(a: Path, b: Path) -> tuple[float, float]:
    """max |a - b| over the final adapters' tensors, and |a - b| / |a| over all of them."""
    from safetensors.torch import load_file

    ta, tb = (load_file(str(p / "final_adapter" / "adapter_model.safetensors")) for p in (a, b))
    diff = sum(float((ta[k] - tb[k]).pow(2).sum()) for k in ta) ** 0.5
    norm = sum(float(ta[k].pow(2).sum()) for k in ta) ** 0.5
    return max(float((ta[k] - tb[k]).abs().max()) for k in ta), diff / max(norm, 1e-30)


def _compare(name: str, a: Path, b: Path) -> str:
    ra, rb = _records(a), _records(b)
    same = [x["rollout/reward_mean"] == y["rollout/reward_mean"] for x, y in zip(ra, rb)]
    first = same.index(False) if False in same else None
    lag_a = [x.get("staleness/mean", 0.0) for x in ra]
    lag_b = [x.get("staleness/mean", 0.0) for x in rb]
    gap, relative = _adapter_gap(a, b)
    mean_gap = sum(abs(x["rollout/reward_mean"] - y["rollout/reward_mean"]) for x, y in zip(ra, rb)) / len(ra)
    return (f"{name}: step rewards equal at {sum(same)}/{len(same)} steps (first difference: "
            f"{'none' if first is None else f'step {first}'}), mean |reward gap| {mean_gap:.4f}, staleness/mean "
            f"per step {lag_a} vs {lag_b}; final adapter max |diff| {gap:.3e}, relative {relative:.3e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stop-after", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    for name in ("straight", "straight_again"):
        _run(_command(args.out / name, args.steps, args.staleness))
    stopped_at = _stopped_then_resumed(args.out / "resumed", args.steps, args.staleness, args.stop_after)
    print(f"rollout.max_staleness={args.staleness}, {args.steps} steps, stopped after {stopped_at} steps")
    print(_compare("straight vs straight again", args.out / "straight", args.out / "straight_again"))
    print(_compare("straight vs stopped+resumed", args.out / "straight", args.out / "resumed"))


if __name__ == "__main__":
    main()

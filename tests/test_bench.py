"""The three benchmarks run end to end on the tiny model and report sane figures (CPU smoke;
the numbers that matter come from the GPU run in BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_server.rollout_profile import busy_us, kernel_kind

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.slow


def _bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "bench", *args, "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_rollout_measures_vllm_and_the_hf_peer(tmp_path):
    report = _bench(tmp_path, "rollout", "--model", "tiny", "--lora-rank", "16", "--concurrency", "8,32",
                    "--prompt-len", "8", "--gen-len", "16", "--samples-per-prompt", "4",
                    "--peer-concurrency", "8", "--peer-gen-len", "8", "--no-request-seeds", "--repeats", "3")
    assert report["args"]["request_seeds"] is False
    rows = {row["seqs"]: row for row in report["rows"]}
    assert set(rows) == {8, 32}
    for row in rows.values():  # the reported figure is the median of the timed runs
        assert len(row["tok_per_s_runs"]) == 3 and row["tok_per_s"] == sorted(row["tok_per_s_runs"])[1]
    assert all(row["tok_per_s"] > 0 and row["floor_tok_per_s"] > row["tok_per_s"] for row in rows.values())
    assert rows[8]["peer_tok_per_s"] > 0 and rows[8]["ratio_to_peer"] == pytest.approx(
        rows[8]["tok_per_s"] / rows[8]["peer_tok_per_s"])
    assert rows[32]["peer_tok_per_s"] is None
    assert report["decode_step_floor_ms"] > 0 and report["environment"]["vllm"].startswith("0.")


def test_bench_rollout_profile_writes_the_op_table(tmp_path):
    report = _bench(tmp_path, "rollout", "--model", "tiny", "--lora-rank", "8", "--concurrency", "8",
                    "--prompt-len", "8", "--gen-len", "8", "--samples-per-prompt", "4", "--peer-concurrency", "",
                    "--repeats", "1", "--profile", str(tmp_path / "profile"), "--profile-seqs", "8")
    profile = report["profile"]
    assert profile["steps"] == 8 and profile["wall_ms_per_step"] > 0
    ops = (tmp_path / "profile" / "ops.txt").read_text()
    assert "Self CPU" in ops  # the CPU engine: a table of ops, no device kernels
    assert profile["device_busy_share"] is None and profile["device_ms_per_step"] == {}


def test_busy_time_is_the_union_of_kernel_intervals():
    intervals = [("a", 0.0, 10.0), ("b", 5.0, 12.0), ("c", 20.0, 25.0), ("d", 21.0, 22.0)]
    assert busy_us(intervals) == 17.0
    assert kernel_kind("_lora_shrink_kernel") == "lora"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_kind("flash_fwd_splitkv_kernel") == "attention"


def test_bench_sync_compares_memory_and_disk(tmp_path):
    # engine cores in their own processes: the in-memory route crosses as a shared-memory file
    report = _bench(tmp_path, "sync", "--model", "tiny", "--lora-rank", "16", "--workers", "2", "--repeats", "3",
                    "--engine-core", "separate")
    routes = [row["route"] for row in report["rows"]]
    assert routes == ["in-memory (object store)", "disk (peft folder, add_lora)"]
    assert all(0 < row["worker_p50_ms"] and 0 < row["p50_ms"] <= row["p95_ms"] for row in report["rows"])
    assert report["adapter_mb"] > 0 and report["args"]["engine_core"] == "separate"
    phases = report["in_memory_phase_p50_ms"]
    assert list(phases) == ["copy", "build", "activate"] and all(ms > 0 for ms in phases.values())
    # the phases are parts of the worker's own load time
    assert sum(phases.values()) <= report["rows"][0]["worker_p50_ms"] * 1.5


def test_bench_learner_covers_formats_and_micro_batches(tmp_path):
    report = _bench(tmp_path, "learner", "--model", "tiny", "--micro-batches", "1,2", "--prompt-len", "8",
                    "--gen-len", "8", "--lora-rank", "8", "--repeats", "1")
    assert [(r["base"], r["micro_batch"]) for r in report["rows"]] == [("nf4", 1), ("nf4", 2), ("bf16", 1), ("bf16", 2)]
    assert all(r["tok_per_s"] > 0 and r["step_ms"] > 0 and r["export_ms"] > 0 for r in report["rows"])


def test_unknown_model_is_a_one_line_error():
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "rollout", "--model", "qwen9-400b"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "qerl: error: --model 'qwen9-400b' is neither 'tiny', a known shape, nor a model folder with config.json"
    ]

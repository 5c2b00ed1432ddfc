"""The benchmarks end to end on the tiny model, in this process (one worker each), checked for
what a broken benchmark would get wrong: token counts, medians, the adapter actually served,
consistent ratios. The figures that matter come from the GPU run in BENCHMARKS.md."""

from __future__ import annotations

import json

import pytest

from benchmarks.fleet import FleetBenchArgs, bench_fleet
from benchmarks.learner import LearnerBenchArgs, bench_learner
from benchmarks.profile import busy_us, kernel_kind
from benchmarks.rollout import RolloutBenchArgs, bench_rollout, sequence_lengths
from benchmarks.sync import SyncBenchArgs, bench_sync
from shared.config import load_config
from shared.errors import QerlError

ONE_WORKER = ["rollout.num_workers=1", "rollout.num_cpus_per_worker=1", "lora.rank=8", "lora.alpha=16"]


@pytest.mark.slow
def test_bench_rollout_measures_vllm_the_profile_and_the_hf_peer(ray_local, tmp_path):
    config = load_config(None, [*ONE_WORKER, "rollout.samples_per_prompt=4", "rollout.request_seeds=false"])
    args = RolloutBenchArgs(concurrency=(8, 16), prompt_len=8, gen_len=12, repeats=3, peer_concurrency=(8,),
                            peer_gen_len=6, profile=str(tmp_path / "profile"), profile_seqs=8,
                            json=str(tmp_path / "result.json"))
    report = bench_rollout(config, args, log=print)
    assert json.loads((tmp_path / "result.json").read_text())["rows"] == report["rows"]
    assert report["config"]["rollout"]["request_seeds"] is False
    rows = {row["seqs"]: row for row in report["rows"]}
    assert set(rows) == {8, 16}
    for seqs, row in rows.items():
        assert row["tokens_per_run"] == [seqs * 12] * 3  # ignore_eos: every sequence runs to gen_len
        assert row["tok_per_s"] == sorted(row["tok_per_s_runs"])[1]  # the median of the timed runs
        assert row["adapter_versions"] == [1]  # every completion came from the pushed adapter
        assert row["floor_tok_per_s"] > row["tok_per_s"] > 0
    assert rows[8]["ratio_to_peer"] == pytest.approx(rows[8]["tok_per_s"] / rows[8]["peer_tok_per_s"])
    assert rows[16]["peer_tok_per_s"] is None
    assert report["peer"]["gen_len"] == 6
    assert [r["format"] for r in report["rows"]] == ["nf4-exact"] * 2  # the config's policy.format
    assert all(r["ratio_to_first"] == 1.0 for r in report["rows"])
    profile = report["profile"]["nf4-exact"]
    assert profile["steps"] == 12 and profile["wall_ms_per_step"] > 0
    # the CPU engine: a table of ops, no device kernels
    assert "Self CPU" in (tmp_path / "profile" / "nf4-exact" / "ops.txt").read_text()
    assert profile["device_busy_share"] is None and profile["device_ms_per_step"] == {}


def test_default_lengths_fit_the_model_and_too_long_is_an_error():
    assert sequence_lengths(None, None, 32768) == (256, 512)
    assert sequence_lengths(None, None, 256) == (64, 128)  # the tiny model's context
    with pytest.raises(QerlError, match="exceed the model's context of 256 tokens"):
        sequence_lengths(256, 512, 256)


@pytest.mark.slow
def test_bench_sync_compares_memory_and_disk(ray_local, tmp_path):
    config = load_config(None, ONE_WORKER)
    report = bench_sync(config, SyncBenchArgs(repeats=3), log=print)
    assert [row["route"] for row in report["rows"]] == ["in-memory (object store)", "disk (peft folder, add_lora)"]
    for row in report["rows"]:
        assert 0 < row["worker_p50_ms"] <= row["p50_ms"] * 1.05 and row["p50_ms"] <= row["p95_ms"]
    assert report["served_adapters"] == [[report["last_version"]]]  # the last push is what serves
    phases = report["in_memory_phase_p50_ms"]
    assert list(phases) == ["copy", "build", "activate"] and all(ms > 0 for ms in phases.values())
    assert sum(phases.values()) <= report["rows"][0]["worker_p50_ms"] * 1.5  # parts of the worker's load


def test_bench_learner_covers_formats_and_micro_batches():
    config = load_config(None, ["lora.rank=8", "lora.alpha=16"])
    report = bench_learner(config, LearnerBenchArgs(micro_batches=(1, 2), prompt_len=8, gen_len=8, repeats=1))
    assert [(r["base"], r["micro_batch"]) for r in report["rows"]] == [("nf4", 1), ("nf4", 2), ("bf16", 1), ("bf16", 2)]
    for row in report["rows"]:
        assert row["tokens"] == row["micro_batch"] * 16
        assert row["tok_per_s"] * row["step_ms"] / 1e3 == pytest.approx(row["tokens"])
        assert row["loss_finite"] and row["grad_norm"] > 0 and row["export_ms"] > 0
        assert row["peak_gib"] is None  # no GPU here


def test_bench_learner_rejects_an_unknown_format():
    with pytest.raises(QerlError, match="--formats int3"):
        bench_learner(load_config(None), LearnerBenchArgs(formats=("int3",)))


def test_busy_time_is_the_union_of_kernel_intervals():
    intervals = [("a", 0.0, 10.0), ("b", 5.0, 12.0), ("c", 20.0, 25.0), ("d", 21.0, 22.0)]
    assert busy_us(intervals) == 17.0
    assert kernel_kind("_lora_shrink_kernel") == "lora"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_kind("flash_fwd_splitkv_kernel") == "attention"


@pytest.mark.slow
def test_bench_fleet_sizes_and_dispatch_with_a_slow_worker(ray_local, tmp_path):
    config = load_config(None, ["rollout.num_cpus_per_worker=1", "lora.rank=8", "lora.alpha=16",
                                "rollout.samples_per_prompt=4", "train.prompts_per_step=8",
                                "rollout.chunk_sequences=8"])
    args = FleetBenchArgs(workers=(1, 2), dispatch=("queue", "slices"), slow_worker=10.0, steps=2, prompt_len=8,
                          gen_len=6, json=str(tmp_path / "fleet.json"))
    report = bench_fleet(config, args, log=print)
    assert json.loads((tmp_path / "fleet.json").read_text())["rows"] == report["rows"]
    rows = {(r["dispatch"], r["workers"]): r for r in report["rows"]}
    assert set(rows) == {("queue", 1), ("queue", 2), ("slices", 1), ("slices", 2)}
    for (dispatch, _), row in rows.items():
        assert row["tokens_per_step"] == 8 * 4 * 6  # ignore_eos: every sequence to gen_len
        assert row["ratio_to_first"] == pytest.approx(row["tok_per_s"] / rows[(dispatch, 1)]["tok_per_s"])
        assert row["generate_tok_per_s"] > row["tok_per_s"] > 0 and row["push_ms"] > 0
    assert rows[("queue", 1)]["chunks_by_worker"] == [4] and rows[("slices", 1)]["chunks_by_worker"] == [1]
    assert rows[("slices", 2)]["chunks_by_worker"] == [1, 1]
    slow, fast = rows[("queue", 2)]["chunks_by_worker"]
    # A chunk takes ~0.06 s here; at 3x a 0.1 s stall under CI load evened the split (2, 2), at
    # 10x the fast worker has ~0.5 s to take its extra chunks.
    assert slow + fast == 4 and slow < fast  # the slowed worker 0 pulled fewer chunks


def test_bench_fleet_bad_sweeps():
    config = load_config(None, [])
    with pytest.raises(QerlError, match="--dispatch takes queue and/or slices"):
        bench_fleet(config, FleetBenchArgs(dispatch=("round-robin",)))
    with pytest.raises(QerlError, match="--slow-worker is a slowdown factor"):
        bench_fleet(config, FleetBenchArgs(slow_worker=0.5))

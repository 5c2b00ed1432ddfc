"""The benchmarks end to end on the tiny model, in this process (one worker each), checked for
what a broken benchmark would get wrong: token counts, medians, the adapter actually served,
consistent ratios. The figures that matter come from the GPU run in BENCHMARKS.md."""

from __future__ import annotations

import json

import pytest

from benchmarks.learner import LearnerBenchArgs, bench_learner
from benchmarks.rollout import RolloutBenchArgs, bench_rollout
from benchmarks.step import StepBenchArgs, bench_step, draw_lengths
from benchmarks.sync import SyncBenchArgs, bench_sync
from shared.config import load_config

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
        # what the engine's worker resolved: the CPU config runs eager
        assert row["cudagraph_mode"] == "NONE" and isinstance(row["async_scheduling"], bool)
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


@pytest.mark.slow
def test_bench_step_times_the_whole_step_and_its_parts(ray_local, tmp_path):
    """qerl bench step on the tiny model: one row per format, the step's parts add up, the
    long-tailed lengths reach the learner (fewer tokens than the limit, some padding saved by
    sorting), and the JSON says what ran."""
    config = load_config(None, [*ONE_WORKER, "train.prompts_per_step=4", "rollout.samples_per_prompt=4"])
    args = StepBenchArgs(formats=("fp32", "int4-dense"), steps=1, gen_len=24, lengths="lognormal",
                         profile=str(tmp_path / "profile"), json=str(tmp_path / "step.json"))
    report = bench_step(config, args, log=print)
    assert json.loads((tmp_path / "step.json").read_text())["rows"] == report["rows"]
    assert report["benchmark"] == "step" and report["args"]["lengths"] == "lognormal"
    assert [row["format"] for row in report["rows"]] == ["fp32", "int4-dense"]
    drawn = sum(draw_lengths(16, 24, "lognormal", seed=1))  # the timed step's lengths
    for row in report["rows"]:
        assert row["step_s"] == pytest.approx(row["rollout_s"] + row["learner_s"] + row["sync_s"], rel=0.05)
        assert 0 < row["completion_tokens"] <= drawn < 16 * 24
        assert row["sequence_tokens"] == row["completion_tokens"] + 16 * args.prompt_len
        assert 0 <= row["padding_frac"] <= row["padding_frac_unsorted"] < 1
        assert row["learner_tok_per_s"] == pytest.approx(row["sequence_tokens"] / row["learner_s"])
        assert row["compiled_layers"] == 0 and row["learner_mfu"] is None  # CPU: eager, no GEMM floor
        # one more learner phase, profiled in the learner actor's process: its op table (CPU ops here)
        profile = row["learner_profile"]
        assert profile["steps"] == 1 and profile["wall_ms"] > 0 and profile["device_ms_per_step"] == {}
        ops = (tmp_path / "profile" / row["format"] / "ops.txt").read_text()
        assert "Self CPU" in ops and "aten::mm" in ops  # the learner's matmuls ran under the profiler
    assert report["rows"][1]["learner_vs_first"] == pytest.approx(
        report["rows"][1]["learner_s"] / report["rows"][0]["learner_s"])


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
        assert row["peak_gib"] is None and row["mfu"] is None  # no GPU here
        assert row["compiled_layers"] == 0  # a CPU runs the layers eager


def test_bench_learner_holds_packed_formats_as_training_does():
    """int4 is built as `qerl train` builds its learner: the tiny model quantized into packed
    layers (a quarter of bf16's bytes for the linear layers), not a dense base."""
    config = load_config(None, ["lora.rank=8", "lora.alpha=16"])
    report = bench_learner(config, LearnerBenchArgs(formats=("bf16", "int4"), micro_batches=(2,), prompt_len=8,
                                                    gen_len=8, repeats=1))
    bf16, int4 = report["rows"]
    assert (bf16["base"], int4["base"]) == ("bf16", "int4")
    assert int4["base_gib"] < 0.75 * bf16["base_gib"]
    assert int4["loss_finite"] and int4["grad_norm"] > 0
    assert bf16["step_vs_first"] == 1.0 and int4["step_vs_first"] == pytest.approx(int4["step_ms"] / bf16["step_ms"])


def test_a_prompt_longer_than_the_models_context_is_one_line(tiny_model, capsys):
    """The check reads the embedded tiny model's config, so it builds the model on a fresh cache."""
    from deploy.cli import main

    assert main(["bench", "rollout", "--prompt-len", "300"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qerl: error: ")
    assert "exceed the model's context of 256 tokens" in lines[0]

"""`qerl bench lora-kernels` on a GPU: a real tuning run (on the embedded tiny model's shapes)
whose files vLLM's own loader reads back."""

from __future__ import annotations

import json

import pytest

from benchmarks import lora_kernels
from benchmarks.lora_kernels import LoraKernelBenchArgs, bench_lora_kernels
from shared.config import load_config


@pytest.mark.gpu
def test_tuning_writes_files_vllm_reads_back(tmp_path, monkeypatch):
    from benchmarks.vllm_lora_kernels import tuned_lora_config

    # two candidates each keep the compile time short; the search itself is what is under test
    monkeypatch.setattr(lora_kernels, "SHRINK_GRID", lora_kernels.SHRINK_GRID[:2])
    monkeypatch.setattr(lora_kernels, "EXPAND_GRID", lora_kernels.EXPAND_GRID[:2])
    out = tmp_path / "kernels"
    out.mkdir()
    (out / "unrelated.txt").write_text("kept")
    report = bench_lora_kernels(load_config(None, ["lora.rank=8"]), LoraKernelBenchArgs(tokens=(16, 64), out=str(out)))
    assert (out / "unrelated.txt").read_text() == "kept"
    names = sorted(p.name for p in out.glob("*.json"))
    assert len(names) == 2 and names[0].endswith("_EXPAND_TRUE.json") and names[1].endswith("_SHRINK.json")
    assert not list(out.glob(".qerl-lora-kernels-*")), "scratch folder left behind"
    for kernel in report["kernels"]:
        assert kernel["best_us"] <= kernel["default_us"]
        found = tuned_lora_config(str(out), kernel["key"])
        assert all(found[name] == value for name, value in kernel["best"].items())
    for tokens, step in report["per_step_us"].items():
        assert 0 < step["tuned_us"] <= step["default_us"], tokens
    json.loads((out / names[1]).read_text())  # valid JSON for the next run to merge into

"""`qerl bench lora-kernels`: the config files vLLM reads, and the one-line refusal without a
GPU (the GPU tuning run: tests/integration/test_lora_kernel_tuning.py)."""

from __future__ import annotations

import pytest

from benchmarks.lora_kernels import LoraKernelBenchArgs, _merged, bench_lora_kernels, config_files
from shared.config import load_config
from shared.errors import QerlError

SHRINK_KEY = {"op_type": "shrink", "max_loras": 2, "batch": 64, "hidden_size": 3584, "rank": 32, "num_slices": 3}
EXPAND_KEY = {"op_type": "expand", "max_loras": 2, "batch": 64, "hidden_size": 18944, "rank": 32, "num_slices": 2,
              "add_inputs": True}


def test_config_files_use_vllms_layout():
    files = config_files([{"key": SHRINK_KEY, "best": {"block_m": 16}},
                          {"key": EXPAND_KEY, "best": {"block_n": 256}}], "NVIDIA_H200")
    # [max_loras][num_slices][m][k][n]: shrink's k is the layer's input, expand's the rank
    assert files == {
        "NVIDIA_H200_SHRINK.json": {"2": {"3": {"64": {"3584": {"32": {"block_m": 16}}}}}},
        "NVIDIA_H200_EXPAND_TRUE.json": {"2": {"2": {"64": {"32": {"18944": {"block_n": 256}}}}}},
    }


def test_new_entries_merge_into_existing_files():
    old = {"2": {"1": {"16": {"896": {"32": {"block_m": 32}}}}}}
    new = {"2": {"1": {"64": {"896": {"32": {"block_m": 64}}}, "16": {"896": {"32": {"block_m": 16}}}}}}
    assert _merged(old, new) == {"2": {"1": {"16": {"896": {"32": {"block_m": 16}}},
                                             "64": {"896": {"32": {"block_m": 64}}}}}}


def test_without_a_gpu_it_is_a_one_line_error():
    pytest.importorskip("vllm")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(QerlError, match="^qerl bench lora-kernels tunes vLLM's CUDA kernels: it needs a CUDA GPU$"):
        bench_lora_kernels(load_config(None), LoraKernelBenchArgs())

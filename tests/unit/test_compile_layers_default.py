"""learner.compile_layers: auto compiles the decoder layers on a GPU for bases whose compiled
layers were checked against the eager ones there (dense, NF4, int4, NVFP4), not for fp8 ones;
true and false are taken as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from learner.actor import compiles_layers
from learner.fp8_layers import Fp8Linear
from learner.packed_layers import Int4Linear, Nvfp4Linear
from shared.config import LearnerConfig


def _base(layer: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Embedding(4, 32), layer)


@pytest.mark.parametrize(("layer", "on_gpu"), [
    (nn.Linear(32, 32), True),
    (Int4Linear(32, 32, group_size=32, scale_dtype=torch.bfloat16), True),
    (Nvfp4Linear(32, 32), True),
    (Fp8Linear(32, 32), False),
])
def test_auto_compiles_on_a_gpu_the_checked_bases_only(layer, on_gpu):
    auto = LearnerConfig()
    assert auto.compile_layers == "auto"
    assert compiles_layers(auto, _base(layer), "cuda") is on_gpu
    assert compiles_layers(auto, _base(layer), "cpu") is False


def test_an_explicit_setting_wins():
    fp8 = _base(Fp8Linear(32, 32))
    assert compiles_layers(LearnerConfig(compile_layers=True), fp8, "cuda") is True
    assert compiles_layers(LearnerConfig(compile_layers=False), _base(nn.Linear(32, 32)), "cuda") is False

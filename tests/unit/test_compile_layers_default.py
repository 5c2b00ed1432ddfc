"""learner.compile_layers: auto compiles the decoder layers on a GPU for every base, and a base
with fp8 (W8A8) layers asks Inductor to round to 16 bits where eager PyTorch does; true and
false are taken as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from learner.actor import compiles_layers
from learner.fp8_layers import Fp8Linear
from learner.lora_graph_pass import FuseSharedInputLoraA
from learner.model import inductor_options
from learner.packed_layers import Int4Linear, Nvfp4Linear
from shared.config import LearnerConfig


def _base(layer: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Embedding(4, 32), layer)


def test_auto_compiles_on_a_gpu_only():
    auto = LearnerConfig()
    assert auto.compile_layers == "auto"
    assert compiles_layers(auto, "cuda") is True
    assert compiles_layers(auto, "cpu") is False


def test_an_explicit_setting_wins():
    assert compiles_layers(LearnerConfig(compile_layers=True), "cpu") is True
    assert compiles_layers(LearnerConfig(compile_layers=False), "cuda") is False


@pytest.mark.parametrize(("layer", "exact_casts"), [
    (nn.Linear(32, 32), False),
    (Int4Linear(32, 32, group_size=32, scale_dtype=torch.bfloat16), False),
    (Nvfp4Linear(32, 32), False),
    (Fp8Linear(32, 32), True),
])
def test_fp8_bases_compile_with_inductor_rounding_as_eager(layer, exact_casts):
    options = inductor_options(_base(layer))
    assert options.get("emulate_precision_casts", False) is exact_casts
    assert isinstance(options["pre_grad_custom_pass"], FuseSharedInputLoraA)

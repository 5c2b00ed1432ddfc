"""The learner's 4-bit base: the quantized folder, the packed layers and their cache, checked
against compressed-tensors' own decompression and a dense reference (CPU, tiny model)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from learner.packed_layers import Int4Linear, Nvfp4Linear, load_packed_base, packed_linear, packed_lora_config
from learner.quantized_folder import MANIFEST, quantized_folder
from shared.errors import QerlError

X = torch.tensor([[5, 6, 7, 8, 9, 10]])


def _folder(tiny_model, tmp_path, scheme: str, dtype: torch.dtype):
    return quantized_folder(tiny_model, scheme, 64, dtype, tmp_path / "cache", log=lambda *_: None)


@pytest.mark.parametrize("scheme, dtype", [("int4", torch.float16), ("nvfp4", torch.bfloat16)])
def test_packed_weights_equal_compressed_tensors_decompression(tiny_model, tmp_path, scheme, dtype):
    folder = _folder(tiny_model, tmp_path, scheme, dtype)
    ours = load_packed_base(folder, compute_dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    reference(X)  # transformers decompresses the whole model at its first forward
    dense = dict(reference.named_modules())
    packed = {name: m for name, m in ours.named_modules() if isinstance(m, (Int4Linear, Nvfp4Linear))}
    assert len(packed) == 7 * AutoConfig.from_pretrained(tiny_model).num_hidden_layers
    for name, module in packed.items():
        assert torch.equal(module.dequantized_weight().to(dtype), dense[name].weight), name


def test_packed_buffers_stay_four_bit_and_lora_trains_on_top(tiny_model, tmp_path):
    from peft import get_peft_model

    base = load_packed_base(_folder(tiny_model, tmp_path, "int4", torch.float16))
    layer = base.model.layers[0].mlp.down_proj
    bytes_per_weight = layer.qweight.numel() * 4 / (layer.in_features * layer.out_features)
    assert layer.qweight.dtype == torch.int32 and bytes_per_weight == 0.5
    assert not any(p.requires_grad for p in base.parameters())
    model = get_peft_model(base, packed_lora_config(base, 4, 8, "all-linear"))
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(lora) == 2 * 7 * 3 and all("lora_" in n for n in lora)
    with torch.no_grad():  # B starts at zero; move it so that A gets a gradient too
        for name, param in lora.items():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    model.train()
    model(input_ids=X).logits.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.values())
    assert all(b.grad is None for b in model.buffers())


def test_backward_through_the_packed_matmul_equals_the_dense_one(tiny_model, tmp_path):
    base = load_packed_base(_folder(tiny_model, tmp_path, "int4", torch.float16))
    layer = base.model.layers[1].self_attn.o_proj
    x = torch.randn(3, layer.in_features, requires_grad=True)
    packed_linear(x, layer).square().sum().backward()
    x_dense = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x_dense, layer.dequantized_weight().float()).square().sum().backward()
    assert torch.allclose(x.grad, x_dense.grad, rtol=1e-5, atol=1e-6)


def test_the_cache_is_reused_and_a_corrupt_entry_rebuilt(tiny_model, tmp_path):
    folder = _folder(tiny_model, tmp_path, "int4", torch.float16)
    weights = folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert _folder(tiny_model, tmp_path, "int4", torch.float16) == folder and weights.stat().st_mtime_ns == stamp
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    rebuilt = _folder(tiny_model, tmp_path, "int4", torch.float16)
    assert rebuilt == folder and json.loads((folder / MANIFEST).read_text())["files"]
    load_packed_base(rebuilt)(X)  # loads and runs again
    other = quantized_folder(tiny_model, "int4", 128, torch.float16, tmp_path / "cache", log=lambda *_: None)
    assert other != folder  # another recipe, another entry


def test_a_broken_source_folder_is_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(QerlError, match="config.json is not valid JSON"):
        quantized_folder(tmp_path, "int4", 64, torch.float16, tmp_path / "cache")
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(QerlError, match="no .safetensors weights"):
        quantized_folder(tmp_path, "int4", 64, torch.float16, tmp_path / "cache")


@pytest.mark.parametrize("scheme", ["int4", "nvfp4", "w8a8"])
def test_random_packed_folder_loads_like_a_quantized_one(tiny_model, tmp_path, scheme):
    from benchmarks.random_quantized import write_random_quantized_folder

    config = AutoConfig.from_pretrained(tiny_model)
    folder = write_random_quantized_folder(config, tmp_path / scheme, scheme, 64, torch.bfloat16, log=lambda *_: None)
    model = load_packed_base(folder, compute_dtype=torch.bfloat16)
    layer = model.model.layers[0].mlp.gate_proj
    codes_per_element = {"int4": 8, "nvfp4": 2, "w8a8": 1}[scheme]  # int32 words, bytes, fp8 values
    assert layer.qweight.shape == (config.intermediate_size, config.hidden_size // codes_per_element)
    assert torch.isfinite(model(X).logits).all()


def test_nvfp4_fused_layers_share_one_global_scale(tiny_model, tmp_path):
    """vLLM fuses q/k/v and gate/up into one layer with one global scale: separate ones served
    wrong weights (measured on the H200: KL 1.09 against the learner before, BENCHMARKS.md)."""
    base = load_packed_base(_folder(tiny_model, tmp_path, "nvfp4", torch.bfloat16), compute_dtype=torch.bfloat16)
    for layer in base.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        assert attention.q_proj.global_scale == attention.k_proj.global_scale == attention.v_proj.global_scale
        assert mlp.gate_proj.global_scale == mlp.up_proj.global_scale
    scales = {float(m.global_scale) for m in base.modules() if isinstance(m, Nvfp4Linear)}
    assert len(scales) > 1  # o_proj and down_proj keep their own

"""Bases with random weights from a config-only folder, for the learner bench and the HF peer:
decode and training speed do not depend on the weight values."""

from __future__ import annotations

from pathlib import Path

import torch

from learner.model import keep_exact_nf4_kernels, load_base
from shared.formats import learner_dtype


def benchmark_base(folder: str | Path, random_weights: bool, base_format: str, device: str, compute_dtype):
    """The base a benchmark measures: random weights for a shape-only folder, else loaded."""
    if random_weights:
        return random_base(folder, base_format, device, compute_dtype)
    return load_base(folder, base_format, device, compute_dtype)


def random_base(folder: str | Path, base_format: str, device: str, compute_dtype=torch.bfloat16):
    """A base with random weights from a config-only folder (benchmarks): built in
    `compute_dtype` on `device`, then every linear layer but the head quantized to NF4."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    dtype = compute_dtype if base_format == "nf4" else learner_dtype(base_format)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Built on a device context the weights can be left uninitialised: set them as a fresh
    # model's would be (norms 1, biases 0, matrices N(0, 0.02)), from a fixed seed so that every
    # run measures the same model (an unseeded one once sampled NaN logits in HF generate).
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02, generator=generator)
            else:
                param.fill_(1.0 if "norm" in name else 0.0)
    if base_format == "nf4":
        quantize_linears_to_nf4(model, compute_dtype)
    model.requires_grad_(False)
    return model


def quantize_linears_to_nf4(model, compute_dtype) -> None:
    """Swap nn.Linear layers (not the output head) for bitsandbytes NF4 ones, double quant."""
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear) or name == "lm_head":
                continue
            device = child.weight.device
            layer = bnb.nn.Linear4bit(
                child.in_features, child.out_features, bias=child.bias is not None,
                compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4", device="meta",
            )
            layer.weight = bnb.nn.Params4bit(
                child.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4"
            ).to(device)
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, layer)
    keep_exact_nf4_kernels(model)

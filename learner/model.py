"""Learner model: the base in NF4 (bitsandbytes, double quant) or a plain dtype, plus a peft LoRA.

`export_rollout_base` writes the base exactly as the learner sees it (NF4 dequantized once) so
that the rollout engines sample from the same policy the learner trains.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from shared.errors import QerlError

_DTYPES = {"nf4": torch.float32, "bf16": torch.bfloat16, "fp32": torch.float32}


def check_model_folder(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise QerlError(f"model path {path} is not a Hugging Face model folder (no config.json)")
    return path


def load_base(path: str | Path, base_format: str, device: str = "cpu", compute_dtype=torch.float32):
    """The frozen base model; NF4 keeps norms and embeddings in `compute_dtype`."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = check_model_folder(path)
    kwargs: dict = {"dtype": _DTYPES[base_format], "device_map": device}
    if base_format == "nf4":
        kwargs["dtype"] = compute_dtype
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.requires_grad_(False)
    _keep_exact_nf4_kernels(model)
    return model


def _keep_exact_nf4_kernels(model) -> None:
    """bitsandbytes repacks NF4 weights for a bf16 CPU kernel at the first no-grad eval forward:
    logprobs drift by ~3e-3 from the dequantized weights and later training steps fail. The
    learner wants the same arithmetic in every mode, so switch that path off."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


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
    dtype = compute_dtype if base_format == "nf4" else _DTYPES[base_format]
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
    _keep_exact_nf4_kernels(model)


def add_lora(model, rank: int, alpha: int, target_modules: str | list[str]):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none"
    )
    return get_peft_model(model, config)


def dequantized_state_dict(model) -> dict[str, torch.Tensor]:
    """The base's weights as dense tensors, NF4 layers dequantized (names as in the HF folder)."""
    import bitsandbytes as bnb

    state = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            state[f"{name}.weight"] = weight.float().cpu()
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias.detach().float().cpu()
        elif not list(module.children()):
            for param_name, param in module.named_parameters(recurse=False):
                state[f"{name}.{param_name}"] = param.detach().float().cpu()
    return state


def export_rollout_base(base, source: str | Path, target: str | Path, dtype: torch.dtype) -> Path:
    """Write a model folder with the learner's view of the base weights (before LoRA is added)."""
    from safetensors.torch import save_file

    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    state = dequantized_state_dict(base)
    if base.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for name in source.iterdir():
        if name.is_file() and ("token" in name.name or name.name in ("vocab.json", "merges.txt", "generation_config.json")):
            shutil.copy(name, target / name.name)
    return target

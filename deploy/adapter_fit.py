"""Does a peft LoRA adapter fit a model? Checked from the safetensors header and the model's
config.json before any engine starts: vLLM loads a misfit adapter without complaint (an
accuracy of 0 or of no adapter at all), where peft refuses the same folder.

A LoRA pair for a linear layer of shape [out, in] is lora_A [r, in] and lora_B [out, r], with r
the adapter_config.json's rank (or its rank_pattern's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from shared.errors import QerlError

_LORA_KEY = re.compile(r"layers\.(\d+)\.(?:\w+\.)*?(\w+)\.lora_([AB])\.weight$")


def linear_shapes(model_config: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of each decoder layer's projections, for Llama/Qwen-style models."""
    hidden, inter = model_config["hidden_size"], model_config["intermediate_size"]
    heads = model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or hidden // heads
    kv = model_config.get("num_key_value_heads") or heads
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden), "v_proj": (kv * head_dim, hidden),
            "o_proj": (hidden, heads * head_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def adapter_misfit(shapes: dict[str, list[int]], rank: int, uniform_rank: bool, model_config: dict) -> str | None:
    """Why the adapter's tensors (name -> shape) do not fit the model, or None."""
    try:
        linear = linear_shapes(model_config)
        layers = int(model_config["num_hidden_layers"])
    except (KeyError, TypeError, ZeroDivisionError):
        linear, layers = {}, None  # another architecture: only the rank is checked
    if not shapes:
        return "it holds no tensors"
    for name, shape in sorted(shapes.items()):
        match = _LORA_KEY.search(name)
        if match is None or len(shape) != 2:
            return f"{name} (shape {shape}) is not a LoRA A/B matrix of a decoder layer"
        layer, module, side = int(match[1]), match[2], match[3]
        tensor_rank = shape[0] if side == "A" else shape[1]
        if uniform_rank and tensor_rank != rank:
            return f"{name} has rank {tensor_rank}, its adapter_config.json says r={rank}"
        if layers is not None and layer >= layers:
            return f"{name}: the model has {layers} layers"
        if module in linear:
            out, inp = linear[module]
            expected = [tensor_rank, inp] if side == "A" else [out, tensor_rank]
            if list(shape) != expected:
                return f"{name} has shape {list(shape)}, the model's {module} needs {expected}"
    return None


def check_adapter_fits(adapter_folder: Path, model_path: str | Path) -> None:
    """A one-line QerlError when the adapter in `adapter_folder` does not fit the model."""
    from safetensors import safe_open

    peft_config = json.loads((adapter_folder / "adapter_config.json").read_text())
    with safe_open(str(adapter_folder / "adapter_model.safetensors"), "pt") as weights:
        shapes = {name: list(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118
    model_config = json.loads((Path(model_path) / "config.json").read_text())
    model_config = model_config.get("text_config", model_config)
    problem = adapter_misfit(shapes, int(peft_config["r"]), not peft_config.get("rank_pattern"), model_config)
    if problem:
        raise QerlError(f"adapter {adapter_folder} does not fit the model {model_path}: {problem}")

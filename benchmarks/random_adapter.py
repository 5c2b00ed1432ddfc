"""Random LoRA adapters of the right shape for any model folder (benchmarks and tests).

Names follow peft (`base_model.model.<module>.lora_A.weight`), every linear layer but the
output head, in the dtype asked for (the learner exports the engine's LoRA dtype); B is
non-zero so the adapter does real work.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shared.adapter_payload import encode_adapter, write_payload
from shared.types import AdapterUpdate


def linear_layer_shapes(model_folder: str | Path) -> dict[str, tuple[int, int]]:
    """{module name: (in_features, out_features)} of the model's linear layers, head excluded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
    }


def random_adapter(
    model_folder: str | Path, rank: int, version: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32
) -> AdapterUpdate:
    generator = torch.Generator().manual_seed(seed)
    shapes = linear_layer_shapes(model_folder)
    tensors = {}
    for name, (fan_in, fan_out) in shapes.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 1e-3
    targets = sorted({name.rsplit(".", 1)[-1] for name in shapes})
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}
    return AdapterUpdate(version=version, payload=encode_adapter(tensors, dtype), peft_config=peft_config)


def write_peft_folder(update: AdapterUpdate, folder: str | Path) -> Path:
    """The same adapter as a standard peft folder (adapter_model.safetensors + adapter_config.json)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_payload(update.payload, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(update.peft_config))
    return folder

"""The policy pair of `policy.format`: the base the learner holds and the base the engines serve.

- "learner" engines (nf4-exact, bf16, fp32): the learner loads the source folder in its format
  and writes the base exactly as it sees it, dense in the engine dtype, for the engines.
- Quantized exact pairs (int4, nvfp4, w8a8): the source is quantized once (round to nearest,
  cached) into a compressed-tensors folder; the learner holds those packed integers (fp8 codes
  for w8a8) and scales, and the engines load the very same folder. For w8a8 the learner also
  rounds each base layer's input per token to fp8, as the engine's kernel does.
- Lossy pairs (nf4-int4, nf4-fp8, nf4-bnb): the learner holds NF4; the engines serve the source
  quantized their own way. Truncated importance sampling corrects the gap.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from learner.model import add_lora, check_model_folder, export_rollout_base, load_base
from learner.quantized_folder import FORMATS, quantized_folder
from shared.config import LoraConfig, PolicyConfig
from shared.formats import POLICY_FORMATS, dtype_of, learner_dtype
from shared.tiny_model import cache_root
from shared.types import ServedBase

PACKED_SCHEMES = tuple(FORMATS)  # the base formats held as quantized tensors (int4, NVFP4, fp8)


def is_packed_folder(folder: Path, scheme: str, group_size: int) -> bool:
    """The folder already holds compressed-tensors weights of this scheme (e.g. random 4-bit
    weights written straight in the packed layout), so it is used as it is."""
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "compressed-tensors":
        return False
    if quant.get("format") != FORMATS[scheme][1]:
        return False
    groups = list(quant.get("config_groups", {}).values())
    if scheme == "w8a8":  # float-quantized also holds static or per-tensor fp8, which Fp8Linear is not
        return all(_is_fp8_dynamic(group) for group in groups)
    return scheme != "int4" or {group.get("weights", {}).get("group_size") for group in groups} == {group_size}


def _is_fp8_dynamic(group: dict) -> bool:
    """compressed-tensors' FP8_DYNAMIC: per-channel fp8 weights, dynamic per-token fp8 inputs."""
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    return (weights.get("strategy"), inputs.get("strategy"), inputs.get("dynamic")) == ("channel", "token", True)


def packed_folder(source: Path, base_format: str, policy: PolicyConfig, engine_dtype: str, log=print) -> Path:
    """The compressed-tensors folder of `source` in `base_format` (int4/nvfp4/w8a8): the source itself
    when it already is one, else written once into the qerl cache, its scales and dense tensors
    in the engines' dtype unless policy.scale_dtype says otherwise."""
    if is_packed_folder(source, base_format, policy.group_size):
        return source
    scale_dtype = engine_dtype if policy.scale_dtype == "auto" else policy.scale_dtype
    return quantized_folder(source, base_format, policy.group_size, dtype_of(scale_dtype), cache_root() / "quantized",
                            log=log)


def load_learner_base(model_path: str, policy: PolicyConfig, device: str, compute_dtype: torch.dtype,
                      engine_dtype: str, log=print):
    """The frozen base as the learner holds it, and the folder it came from."""
    source = check_model_folder(model_path)
    learner_format = POLICY_FORMATS[policy.format].learner
    if learner_format in PACKED_SCHEMES:
        from learner.packed_layers import load_packed_base

        folder = packed_folder(source, learner_format, policy, engine_dtype, log)
        return load_packed_base(folder, device=device, compute_dtype=compute_dtype), folder
    return load_base(source, learner_format, device, compute_dtype), source


def random_base(source: Path, policy: PolicyConfig, device: str):
    """A dense base of `source`'s shape with random weights, drawn where it will live (a 32B
    bf16 base is 61 GiB: it never exists on disk or in host memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(check_model_folder(source))
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=learner_dtype(POLICY_FORMATS[policy.format].learner))
    return base.requires_grad_(False)


def served_base(base, source: Path, learner_folder: Path, policy: PolicyConfig, run_dir: str,
                engine_dtype: str, log=print) -> ServedBase:
    """What the engines load for this pair (written where it must be)."""
    pair = POLICY_FORMATS[policy.format]
    if pair.engine == "learner":
        target = export_rollout_base(base, source, Path(run_dir) / "rollout_base", dtype_of(engine_dtype))
        return ServedBase(str(target), None, pair.name)
    if pair.engine in PACKED_SCHEMES:
        folder = learner_folder if pair.exact else packed_folder(source, pair.engine, policy, engine_dtype, log)
        return ServedBase(str(folder), None, pair.name)
    return ServedBase(str(source), pair.vllm_quantization, pair.name)


def add_policy_lora(base, lora: LoraConfig, policy: PolicyConfig):
    """peft LoRA on the base; packed (quantized) layers go through peft's custom-module hook."""
    if POLICY_FORMATS[policy.format].learner in PACKED_SCHEMES:
        from peft import get_peft_model

        from learner.packed_layers import packed_lora_config

        return get_peft_model(base, packed_lora_config(base, lora.rank, lora.alpha, lora.target_modules))
    return add_lora(base, lora.rank, lora.alpha, lora.target_modules)

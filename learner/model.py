"""Learner model: the base in NF4 (bitsandbytes, double quant) or a plain dtype, plus a peft LoRA.

`export_rollout_base` writes the base exactly as the learner sees it (NF4 dequantized once) so
that the rollout engines sample from the same policy the learner trains.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from shared.errors import QerlError, read_utf8
from shared.formats import learner_dtype

TOKENIZER_AND_GENERATION_FILES = ("vocab.json", "merges.txt", "generation_config.json")


def check_model_folder(path: str | Path) -> Path:
    """`path` if it looks like a Hugging Face model folder; one-line errors naming the file."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise QerlError(f"model path {path} is not a Hugging Face model folder (no config.json)")
    try:
        fields = json.loads(read_utf8(config))
    except json.JSONDecodeError as error:
        raise QerlError(f"{config} is not valid JSON ({error.msg}, line {error.lineno})") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise QerlError(f"{config} has no model_type")
    from transformers import CONFIG_MAPPING

    if fields["model_type"] not in CONFIG_MAPPING:
        raise QerlError(f"{config}: unknown model_type {fields['model_type']!r}")
    return path


def resolve_model_path(model_path: str | None, log=print) -> str:
    """model.path checked as a model folder, or the embedded tiny model's folder (built once)."""
    if model_path is None:
        from shared.tiny_model import tiny_model_path, tiny_model_report

        path = tiny_model_path(log=log)
        accuracy = tiny_model_report(path)["greedy_accuracy"]
        log(f"[qerl] embedded tiny model {path.name}: starting greedy accuracy {accuracy:.0%}")
        return str(path)
    return str(check_model_folder(model_path).resolve())


def context_length_problem(path: str | Path, max_model_len: int) -> str | None:
    """Why vLLM would refuse rollout.max_model_len for this model (its own error is a pydantic
    ValidationError that does not say why), or None. Rope-scaled models are left to vLLM."""
    fields = json.loads(read_utf8(Path(path) / "config.json"))
    fields = fields.get("text_config", fields)
    limit = fields.get("max_position_embeddings")
    rope = fields.get("rope_scaling") or fields.get("rope_parameters") or {}
    scaled = isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default"
    if isinstance(limit, int) and max_model_len > limit and not scaled:
        return (f"rollout.max_model_len {max_model_len} is more than the model's context "
                f"(max_position_embeddings {limit} in {Path(path) / 'config.json'}); lower it")
    return None


def load_base(path: str | Path, base_format: str, device: str = "cpu", compute_dtype=torch.float32):
    """The frozen base model; NF4 keeps norms and embeddings in `compute_dtype`."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = check_model_folder(path)
    kwargs: dict = {"dtype": learner_dtype(base_format), "device_map": device}
    if base_format == "nf4":
        kwargs["dtype"] = compute_dtype
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as error:  # a broken weights file: name the folder, keep the library's reason
        raise QerlError(f"cannot load the weights in {path}: {str(error).splitlines()[0]}") from None
    model.requires_grad_(False)
    keep_exact_nf4_kernels(model)
    return model


def keep_exact_nf4_kernels(model) -> None:
    """bitsandbytes repacks NF4 weights for a bf16 CPU kernel at the first no-grad eval forward:
    logprobs drift by ~3e-3 from the dequantized weights and later training steps fail. The
    learner wants the same arithmetic in every mode, so switch that path off."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def add_lora(model, rank: int, alpha: int, target_modules: str | list[str]):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none"
    )
    return get_peft_model(model, config)


def compile_decoder_layers(model, backend: str = "inductor") -> int:
    """torch.compile every decoder layer of `model` (a causal LM or a peft model around one) in
    place; returns how many. The layers share one graph: dynamo treats a layer's parameters as
    inputs, and dynamic shapes spare a recompile per micro-batch width. `backend` "eager" traces
    the same graphs without generating kernels (a quick check of the graph count)."""
    import torch._dynamo

    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = causal.get_decoder().layers
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    options = inductor_options(model) if backend == "inductor" else None
    for layer in layers:
        layer.compile(dynamic=True, backend=backend, options=options)
    # the first layer's input (frozen embeddings) would carry no gradient and the others' would:
    # dynamo guards on that, so a training pass compiled two graphs. The price of one: layer 0's
    # input gradient, its q/k/v projections' share of one layer's backward.
    causal.get_input_embeddings().register_forward_hook(_output_requires_grad)
    return len(layers)


def _output_requires_grad(module, inputs, output: torch.Tensor) -> None:
    if torch.is_grad_enabled() and not output.requires_grad:  # not under no_grad: one graph there already
        output.requires_grad_(True)


def inductor_options(model) -> dict:
    """Inductor settings for the compiled layers. LoRA's down-projections on a shared input run
    as one GEMM (learner.lora_graph_pass). A base with fp8 (W8A8) layers rounds to 16 bits
    wherever eager PyTorch does (emulate_precision_casts): Inductor otherwise keeps fused
    intermediates in fp32, and fp8's 3-bit mantissa turns those 1-ulp differences into code
    flips (the compiled layers' LoRA gradients were 13 % off the eager ones on an H100, 0.0 %
    with the setting; docs/training.md)."""
    from learner.fp8_layers import Fp8Linear
    from learner.lora_graph_pass import FuseSharedInputLoraA

    options = {"pre_grad_custom_pass": FuseSharedInputLoraA()}
    if any(isinstance(module, Fp8Linear) for module in model.modules()):
        options["emulate_precision_casts"] = True
    return options


def dequantized_state_dict(model) -> dict[str, torch.Tensor]:
    """The base's weights as dense tensors, NF4 and packed 4-bit layers dequantized (names as in
    the HF folder)."""
    import bitsandbytes as bnb

    state = {}
    for name, module in model.named_modules():
        if hasattr(module, "dequantized_weight"):  # learner.packed_layers: int4 / NVFP4
            state[f"{name}.weight"] = module.dequantized_weight().float().cpu()
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias.detach().float().cpu()
        elif isinstance(module, bnb.nn.Linear4bit):
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
        if name.is_file() and ("token" in name.name or name.name in TOKENIZER_AND_GENERATION_FILES):
            shutil.copy(name, target / name.name)
    return target

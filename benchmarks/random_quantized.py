"""A compressed-tensors int4/NVFP4/W8A8-FP8 folder with random weights, written straight in the packed
layout, layer by layer, in shards: a 32B shape needs about 19 GB this way and never exists
dense (its bf16 copy would be 65 GB, more than the GPU machine's disk). vLLM and
`learner.packed_layers.load_packed_base` load it as any quantized folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SHARD_BYTES = 4 * 2**30


def _packed_linear(prefix: str, rows: int, cols: int, scheme: str, group_size: int, dtype: torch.dtype,
                   generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random codes with plausible scales (weights of about N(0, 0.02)), in the folder layout."""
    if scheme == "int4":
        words = torch.randint(-(2**31), 2**31 - 1, (rows, cols // 8), dtype=torch.int32, generator=generator)
        scale = torch.empty(rows, cols // group_size).uniform_(0.004, 0.008, generator=generator).to(dtype)
        return {f"{prefix}.weight_packed": words, f"{prefix}.weight_scale": scale,
                f"{prefix}.weight_shape": torch.tensor([rows, cols], dtype=torch.int64)}
    if scheme == "w8a8":  # fp8 codes of about N(0, 100) (no NaN bytes), one scale per output channel
        codes = (torch.randn(rows, cols, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.empty(rows, 1).uniform_(1.5e-4, 2.5e-4, generator=generator).to(dtype)
        return {f"{prefix}.weight": codes, f"{prefix}.weight_scale": scale}
    codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
    scale = torch.empty(rows, cols // 16).uniform_(0.5, 1.0, generator=generator).to(torch.float8_e4m3fn)
    return {f"{prefix}.weight_packed": codes, f"{prefix}.weight_scale": scale,
            f"{prefix}.weight_global_scale": torch.tensor([100.0], dtype=torch.float32)}


def _layer_tensors(config, index: int, scheme: str, group_size: int, dtype: torch.dtype,
                   generator: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, inner = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    prefix = f"model.layers.{index}"
    shapes = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
              "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inner, hidden), "mlp.up_proj": (inner, hidden),
              "mlp.down_proj": (hidden, inner)}
    tensors: dict[str, torch.Tensor] = {}
    for name, (rows, cols) in shapes.items():
        tensors |= _packed_linear(f"{prefix}.{name}", rows, cols, scheme, group_size, dtype, generator)
    for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):  # Qwen2's attention biases
        tensors[f"{prefix}.self_attn.{name}.bias"] = torch.zeros(size, dtype=dtype)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        tensors[f"{prefix}.{norm}.weight"] = torch.ones(hidden, dtype=dtype)
    return tensors


def write_random_quantized_folder(config, target: str | Path, scheme: str, group_size: int = 128,
                                  dtype: torch.dtype = torch.bfloat16, seed: int = 0, log=print) -> Path:
    """Write the folder for the transformers `config` (a Qwen2-style decoder)."""
    from safetensors.torch import save_file

    from benchmarks.shapes import quantization_config

    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shards = 0

    def flush() -> None:
        nonlocal shard, shards
        shards += 1
        name = f"model-{shards:05d}.safetensors"
        save_file(shard, str(target / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard = {}

    embedding = (torch.randn(config.vocab_size, config.hidden_size, generator=generator) * 0.02).to(dtype)
    shard["model.embed_tokens.weight"] = embedding
    if not config.tie_word_embeddings:
        shard["lm_head.weight"] = (torch.randn(config.vocab_size, config.hidden_size, generator=generator)
                                   * 0.02).to(dtype)
    shard["model.norm.weight"] = torch.ones(config.hidden_size, dtype=dtype)
    for index in range(config.num_hidden_layers):
        shard |= _layer_tensors(config, index, scheme, group_size, dtype, generator)
        if sum(t.numel() * t.element_size() for t in shard.values()) >= SHARD_BYTES:
            flush()
            log(f"[qerl]   wrote layers up to {index + 1} of {config.num_hidden_layers}")
    if shard:
        flush()
    # rename to vLLM's "-of-" convention now that the count is known
    final_map = {}
    for number in range(1, shards + 1):
        old, new = f"model-{number:05d}.safetensors", f"model-{number:05d}-of-{shards:05d}.safetensors"
        (target / old).rename(target / new)
        final_map.update({k: new for k, v in weight_map.items() if v == old})
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": final_map}))
    config_dict = config.to_dict()
    config_dict["quantization_config"] = quantization_config(scheme, group_size)
    config_dict["torch_dtype"] = config_dict["dtype"] = str(dtype).removeprefix("torch.")
    (target / "config.json").write_text(json.dumps(config_dict, indent=2))
    return target

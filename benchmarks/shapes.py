"""Named model shapes for benchmarks: a config-only folder, weights random (vLLM `dummy` load).

Decode speed does not depend on weight values when every request runs to max_tokens, so a
shape is enough to measure throughput and memory without downloading a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from shared.errors import QerlError

QWEN25_SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
SHAPE_NAMES = tuple(QWEN25_SHAPES)


def shape_folder(name: str) -> Path:
    """A folder holding only config.json for the named shape (created in the qerl cache)."""
    from transformers import Qwen2Config

    if name not in QWEN25_SHAPES:
        raise QerlError(f"unknown model shape {name!r}; known: {', '.join(QWEN25_SHAPES)}")
    folder = cache_root_shapes() / name
    if not (folder / "config.json").is_file():
        config = Qwen2Config(
            **QWEN25_SHAPES[name], max_position_embeddings=32768, rope_theta=1_000_000.0,
            rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16",
        )
        config.save_pretrained(folder)
    return folder


def quantization_config(scheme: str, group_size: int) -> dict:
    """config.json's quantization_config for a compressed-tensors int4 (`pack-quantized`,
    symmetric, group scales) or NVFP4 weight-only folder, `lm_head` left dense."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    from learner.quantized_folder import FORMATS

    preset_name, packing = FORMATS[scheme]
    preset = preset_name_to_scheme(preset_name, ["Linear"])
    preset.format = packing  # as compressed-tensors writes it for a quantized model
    if scheme == "int4":
        preset.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": preset}, ignore=["lm_head"], quantization_status="compressed",
                                format=packing)
    return config.model_dump()


def quantized_shape_folder(name: str, scheme: str, group_size: int) -> Path:
    """A config-only folder for the named shape in int4/NVFP4: vLLM's dummy load gives it random
    packed weights of the right layout (engine benchmarks, nothing on disk but config.json)."""
    import json

    folder = cache_root_shapes() / f"{name}-{scheme}-g{group_size}"
    config = json.loads((shape_folder(name) / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme, group_size)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def random_packed_shape_folder(name: str, scheme: str, group_size: int) -> Path:
    """A loadable folder of the named shape with random int4/NVFP4/W8A8 weights, written once
    into the qerl cache and reused by later runs (the step and learner benchmarks)."""
    folder = cache_root_shapes() / f"{name}-{scheme}-g{group_size}-packed"
    if not (folder / "config.json").is_file():
        write_random_packed_model(name, folder, scheme, group_size)
    return folder


def cache_root_shapes() -> Path:
    from shared.tiny_model import cache_root

    return cache_root() / "shapes"


def write_random_model(name: str, folder: str | Path, seed: int = 0) -> Path:
    """A loadable model folder for the named shape: random bf16 weights + the character
    tokenizer, for end-to-end runs at real scale where the values do not matter."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shared.tiny_model import build_tokenizer

    folder = Path(folder)
    config = AutoConfig.from_pretrained(shape_folder(name))
    tokenizer = build_tokenizer()
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_shape_model(name: str, folder: str | Path) -> Path:
    """The named shape's config.json and the character tokenizer, no weights: a model.path for
    `qerl train model.random_weights=true` (the learner draws its weights in memory, the engines
    use vLLM's dummy load)."""
    from transformers import AutoConfig

    from shared.tiny_model import build_tokenizer

    folder = Path(folder)
    config = AutoConfig.from_pretrained(shape_folder(name))
    tokenizer = build_tokenizer()
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_random_packed_model(name: str, folder: str | Path, scheme: str, group_size: int = 128, seed: int = 0) -> Path:
    """A loadable int4/NVFP4 compressed-tensors folder for the named shape, random weights
    written layer by layer straight in the packed layout (a bf16 copy of a 32B shape would not
    fit a 64 GiB disk), plus the character tokenizer."""
    import torch
    from transformers import AutoConfig

    from benchmarks.random_quantized import write_random_quantized_folder
    from shared.tiny_model import build_tokenizer

    folder = Path(folder)
    config = AutoConfig.from_pretrained(shape_folder(name))
    tokenizer = build_tokenizer()
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    write_random_quantized_folder(config, folder, scheme, group_size, torch.bfloat16, seed)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.shapes",
                                     description="write a loadable model folder of a named shape, random weights")
    parser.add_argument("shape", choices=SHAPE_NAMES)
    parser.add_argument("folder")
    parser.add_argument("--packed", choices=["int4", "nvfp4", "w8a8"], default=None,
                        help="write the weights straight in this compressed-tensors layout (default: bf16)")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--shape-only", action="store_true",
                        help="config.json and tokenizer only, for qerl train model.random_weights=true")
    args = parser.parse_args(argv)
    if args.shape_only:
        print(write_shape_model(args.shape, args.folder))
    elif args.packed:
        print(write_random_packed_model(args.shape, args.folder, args.packed, args.group_size))
    else:
        print(write_random_model(args.shape, args.folder))


if __name__ == "__main__":
    main()

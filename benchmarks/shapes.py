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

    from shared.tiny_model import cache_root

    if name not in QWEN25_SHAPES:
        raise QerlError(f"unknown model shape {name!r}; known: {', '.join(QWEN25_SHAPES)}")
    folder = cache_root() / "shapes" / name
    if not (folder / "config.json").is_file():
        config = Qwen2Config(
            **QWEN25_SHAPES[name], max_position_embeddings=32768, rope_theta=1_000_000.0,
            rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16",
        )
        config.save_pretrained(folder)
    return folder


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


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m benchmarks.shapes SHAPE OUTPUT_FOLDER")
    print(write_random_model(sys.argv[1], sys.argv[2]))

"""Offline round-to-nearest quantization of a model folder into a compressed-tensors folder that
vLLM loads as it is (int4 `pack-quantized`, symmetric, group scales; NVFP4 weight-only; or W8A8
FP8: fp8 weights with per-channel scales, activations quantized per token by the engine), with
compressed-tensors alone, written once and cached.

The cache entry is keyed by the source (its config and its weight files' names, sizes and
modification times) and the recipe (scheme, group, dtype, recipe version). It holds a manifest
of every file it wrote (size, and a checksum of its head and tail); an entry that does not match
its manifest is rebuilt, never served.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from learner.model import check_model_folder
from shared.errors import QerlError

RECIPE_VERSION = 2  # 2: NVFP4 global scales shared across fused layers
MANIFEST = "qerl_quantized.json"
_CHECKSUM_SPAN = 4 * 2**20  # bytes hashed at each end of a file: catches truncation and garbled headers
# scheme (the base format's name) -> (compressed-tensors preset, packing format written to disk)
FORMATS = {"int4": ("W4A16", "pack-quantized"), "nvfp4": ("NVFP4A16", "nvfp4-pack-quantized"),
           "w8a8": ("FP8_DYNAMIC", "float-quantized")}
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "vocab.json", "merges.txt", "chat_template.jinja")


def scheme_of(quantization_config: dict) -> str:
    """The scheme (FORMATS key) of a compressed-tensors folder's `quantization_config`."""
    packing = quantization_config.get("format")
    scheme = next((name for name, (_, written) in FORMATS.items() if written == packing), None)
    if scheme is None:
        raise QerlError(f"compressed-tensors format {packing!r} is none of qerl's "
                        f"({', '.join(w for _, w in FORMATS.values())})")
    return scheme


def source_fingerprint(source: Path) -> str:
    """What the cache key knows of the source: its config and its weight files' identities."""
    digest = hashlib.sha256((source / "config.json").read_bytes())
    for file in sorted(source.glob("*.safetensors")):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def cache_key(source: Path, scheme: str, group_size: int, dtype: torch.dtype) -> str:
    recipe = {"source": source_fingerprint(source), "scheme": scheme, "group_size": _group_of(scheme, group_size),
              "dtype": str(dtype), "version": RECIPE_VERSION}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _group_of(scheme: str, group_size: int) -> int | None:
    """The group the scheme's scales cover: policy.group_size for int4, 16 for NVFP4, a whole
    output channel (None) for W8A8."""
    return {"int4": group_size, "nvfp4": 16}.get(scheme)


def quantized_folder(source: str | Path, scheme: str, group_size: int, dtype: torch.dtype, cache_root: Path,
                     log=print) -> Path:
    """The cached compressed-tensors folder of `source` in `scheme`, built first if missing or
    if the cached one does not match its manifest."""
    source = Path(source)
    _check_source(source)
    key = cache_key(source, scheme, group_size, dtype)
    group = f"-g{group_size}" if scheme == "int4" else ""
    target = cache_root / f"{source.name}-{scheme}{group}-{key}"
    if folder_matches_manifest(target, key):
        return target
    if target.exists():
        log(f"[qerl] cached quantized folder {target} does not match its manifest: rebuilding it")
        shutil.rmtree(target)
    cache_root.mkdir(parents=True, exist_ok=True)
    log(f"[qerl] quantizing {source} to {scheme}{f' g{group_size}' if scheme == 'int4' else ''} "
        f"(once; cached in {target})")
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=".quantizing-", dir=cache_root))
    try:
        quantize_model_folder(source, staging, scheme, group_size, dtype)
        write_manifest(staging, key)
        try:
            staging.rename(target)
        except OSError:  # another process finished first: theirs is checked on the next use
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"[qerl] quantized in {time.perf_counter() - started:.1f} s")
    return target


def _check_source(source: Path) -> None:
    check_model_folder(source)  # config.json present, JSON, a known model_type
    if not list(source.glob("*.safetensors")):
        raise QerlError(f"model path {source} has no .safetensors weights to quantize")


def quantize_model_folder(source: Path, target: Path, scheme: str, group_size: int, dtype: torch.dtype) -> None:
    """Round-to-nearest `scheme` quantization of every linear layer but lm_head, with
    compressed-tensors' own qparams and packing, written where vLLM reads it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam, is_module_quantized
    from transformers import AutoModelForCausalLM

    preset_name, packing = FORMATS[scheme]
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError, KeyError) as error:
        raise QerlError(f"cannot read the weights of {source}: {str(error).splitlines()[0]}") from None
    preset = preset_name_to_scheme(preset_name, ["Linear"])
    if scheme == "int4":
        preset.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": preset}, ignore=["lm_head"], quantization_status="frozen")
    apply_quantization_config(model, config)
    quantized = {name: module for name, module in model.named_modules() if is_module_quantized(module)}
    global_scales = _shared_global_scales(quantized, generate_gparam) if scheme == "nvfp4" else {}
    with torch.no_grad():
        for name, module in quantized.items():
            args = module.quantization_scheme.weights
            grouped = _grouped(module.weight.float(), args.group_size)
            global_scale = global_scales.get(name)
            scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args, global_scale=global_scale)
            module.weight_scale.copy_(scale)
            if global_scale is not None:
                module.weight_global_scale.copy_(global_scale)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=packing)
    # NVFP4's rounding is a torch.compile'd function that recompiles for every layer shape;
    # eager gives the same codes at a fraction of the time
    with torch.compiler.set_stance("force_eager"):
        compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(target)
    for name in COPIED:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)


def _grouped(weight: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """[rows, groups, group] view of a weight for its scales' ranges; a whole row is one group
    (per-channel scales, [rows, 1])."""
    rows, cols = weight.shape
    group_size = group_size or cols
    if cols % group_size:
        raise QerlError(f"policy.group_size {group_size} does not divide a layer's {cols} inputs")
    return weight.reshape(rows, cols // group_size, group_size)


# Layers vLLM fuses into one: they must share NVFP4's global scale, since the fused layer keeps one
# (llm-compressor shares it the same way). A separate scale each serves wrong weights.
FUSED_LAYERS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _shared_global_scales(quantized: dict[str, torch.nn.Module], generate_gparam) -> dict[str, torch.Tensor]:
    """Each quantized layer's NVFP4 global scale, taken over the range of its fused group."""
    groups: dict[str, list[str]] = {}
    for name in quantized:
        parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        fused = next((members for members in FUSED_LAYERS if leaf in members), None)
        key = f"{parent}.{fused}" if fused else name
        groups.setdefault(key, []).append(name)
    scales = {}
    for members in groups.values():
        low = min(quantized[m].weight.float().min() for m in members)
        high = max(quantized[m].weight.float().max() for m in members)
        scales |= dict.fromkeys(members, generate_gparam(low, high))
    return scales


def _checksum(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as file:
        digest.update(file.read(_CHECKSUM_SPAN))
        if size > 2 * _CHECKSUM_SPAN:
            file.seek(size - _CHECKSUM_SPAN)
        digest.update(file.read())
    return digest.hexdigest()


def write_manifest(folder: Path, key: str) -> None:
    files = {f.name: _checksum(f) for f in sorted(folder.iterdir()) if f.is_file() and f.name != MANIFEST}
    path = folder / MANIFEST
    path.write_text(json.dumps({"key": key, "files": files}, indent=1))
    with path.open("rb") as handle:  # the manifest is the entry's seal: on disk before the rename
        os.fsync(handle.fileno())


def folder_matches_manifest(folder: Path, key: str) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return manifest["key"] == key and all(
            (folder / name).is_file() and _checksum(folder / name) == checksum
            for name, checksum in manifest["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False

"""The learner's resumable state as files, without pickle: tensors in one safetensors blob,
everything else (optimizer hyper-parameters, schedule counters, the adapter version) in JSON.

torch's optimizer and scheduler state dicts are trees of dicts (int keys), lists, tuples,
numbers and tensors; `flatten` swaps every tensor for a {"tensor": key} leaf and every dict for
a list of [key, value] pairs, so int keys survive JSON."""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors


def flatten(tree: Any, tensors: dict[str, torch.Tensor], path: str = "t") -> Any:
    if isinstance(tree, torch.Tensor):
        tensors[path] = tree.detach().cpu().contiguous()
        return {"tensor": path}
    if isinstance(tree, dict):
        return {"dict": [[key, flatten(value, tensors, f"{path}.{key}")] for key, value in tree.items()]}
    if isinstance(tree, (list, tuple)):
        return {"list": [flatten(value, tensors, f"{path}.{index}") for index, value in enumerate(tree)]}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return {"value": tree}
    raise TypeError(f"cannot store a {type(tree).__name__} in a checkpoint")


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if "tensor" in skeleton:
        return tensors[skeleton["tensor"]]
    if "dict" in skeleton:
        return {key: unflatten(value, tensors) for key, value in skeleton["dict"]}
    if "list" in skeleton:
        return [unflatten(value, tensors) for value in skeleton["list"]]
    return skeleton["value"]


def encode_state(state: dict) -> tuple[bytes, bytes]:
    """(safetensors bytes, JSON bytes) of a state tree."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten(state, tensors)
    return save_safetensors(tensors), json.dumps(skeleton).encode()


def decode_state(tensor_bytes: bytes, skeleton_bytes: bytes) -> dict:
    return unflatten(json.loads(skeleton_bytes), load_safetensors(tensor_bytes))

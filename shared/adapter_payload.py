"""The in-memory adapter format: safetensors bytes held in a numpy uint8 array.

Why numpy: Ray hands numpy arrays to other actors zero-copy from its shared-memory object
store, while a Python `bytes` object is pickled and copied at every hop (measured: 0.45-2.9 s
to put 308 MB of bytes vs 0.14 s as an array). The receiver copies once into private memory
and views the tensors in place. (vLLM's multiprocess RPC turns arrays into nested lists, so
a worker whose engine core runs in another process sends the bytes instead.)
"""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import save

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def encode_adapter(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> np.ndarray:
    """Tensors -> safetensors bytes in `dtype` (the engine's LoRA dtype), as a uint8 array."""
    blob = save({name: t.detach().to("cpu", dtype).contiguous() for name, t in tensors.items()})
    return np.frombuffer(blob, dtype=np.uint8)


def decode_adapter(payload: np.ndarray | bytes) -> dict[str, torch.Tensor]:
    """A safetensors payload (uint8 array, or bytes after a process hop) -> tensors viewing one
    private copy of it."""
    data = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
    if data.numel() < 8:
        raise ValueError("adapter payload is not in safetensors format (too short)")
    header_len = int.from_bytes(data[:8].numpy().tobytes(), "little")
    try:
        header = json.loads(data[8 : 8 + header_len].numpy().tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("adapter payload is not in safetensors format (bad header)") from None
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"adapter tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        raw = data[base + start : base + end]
        tensors[name] = raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def payload_bytes(payload: np.ndarray) -> bytes:
    """The payload as a safetensors file's bytes (for writing a peft folder)."""
    return payload.tobytes()

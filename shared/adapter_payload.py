"""The in-memory adapter format: safetensors bytes held in a numpy uint8 array.

Why numpy: Ray hands numpy arrays to other actors zero-copy from its shared-memory object
store, while a Python `bytes` object is pickled and copied at every hop (BENCHMARKS.md has the
figures). The receiver copies once (into private memory,
or in one host-to-device transfer) and views the tensors in place. (vLLM's multiprocess RPC
turns arrays into nested lists and is slow with bytes, so a worker whose engine core runs in
another process hands the payload over as a shared-memory file.)
"""

from __future__ import annotations

import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from shared.formats import SAFETENSORS_DTYPES, safetensors_code

_COPY_CHUNK = 8 * 2**20
COPY_THREADS = min(8, os.cpu_count() or 1)


def copy_in_parallel(target: np.ndarray, source: np.ndarray, threads: int = COPY_THREADS) -> None:
    """target[:] = source, in 8 MB chunks on several threads (numpy drops the GIL to copy).

    A Ray actor's torch runs on its CPU share (one thread), and a freshly put object's pages
    fault in as they are first read: one thread leaves most of the host's copy bandwidth unused
    (`qerl bench sync`'s copy phase, BENCHMARKS.md)."""
    if threads <= 1 or source.size <= _COPY_CHUNK:
        np.copyto(target, source)
        return

    def copy_chunk(start: int) -> None:
        np.copyto(target[start : start + _COPY_CHUNK], source[start : start + _COPY_CHUNK])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(copy_chunk, range(0, source.size, _COPY_CHUNK)))


def encode_adapter(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> np.ndarray:
    """Tensors -> safetensors bytes in `dtype` (the engine's LoRA dtype), as a uint8 array.

    Each tensor is converted and copied straight into its slice of one buffer: the output on
    the CPU, a device buffer that then comes over in one copy on a GPU; no intermediate CPU
    copies of a 150 MB adapter."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * dtype.itemsize
        header[name] = {"dtype": safetensors_code(dtype), "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # keeps every tensor aligned, as safetensors does
    start = 8 + len(header_bytes)
    out = np.empty(start + offset, dtype=np.uint8)
    out[:8] = np.frombuffer(len(header_bytes).to_bytes(8, "little"), dtype=np.uint8)
    out[8:start] = np.frombuffer(header_bytes, dtype=np.uint8)
    data = torch.from_numpy(out[start:])
    devices = {tensor.device for tensor in tensors.values()}
    if devices <= {torch.device("cpu")}:
        _pack(tensors, header, data, dtype)
    else:
        # Pack on the GPU, then one device-to-host copy: a copy per tensor waits for the device
        # each time (hundreds of tensors for a 7B adapter).
        staged = torch.empty(offset, dtype=torch.uint8, device=next(iter(devices - {torch.device("cpu")})))
        _pack(tensors, header, staged, dtype)
        data.copy_(staged)
    return out


def _pack(tensors: dict[str, torch.Tensor], header: dict, data: torch.Tensor, dtype: torch.dtype) -> None:
    """Each tensor, converted to `dtype`, into its slice of the uint8 buffer `data`."""
    for name, tensor in tensors.items():
        first, last = header[name]["data_offsets"]
        data[first:last].view(dtype).copy_(tensor.detach().reshape(-1))


def decode_adapter(payload: np.ndarray | bytes, device: str | torch.device = "cpu",
                   staging: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A safetensors payload (uint8 array or bytes) -> tensors on `device`.

    The payload is copied exactly once: into private CPU memory (the object store's buffer
    must not stay pinned by a cached adapter), or in one host-to-device transfer straight
    from the object store's read-only buffer. With `staging` (pinned host memory of at least
    the payload's size) a GPU upload goes through it instead: a host memcpy plus a DMA.
    """
    raw = np.frombuffer(payload, dtype=np.uint8)
    if raw.size < 8:
        raise ValueError("adapter payload is not in safetensors format (too short)")
    header_len = int.from_bytes(raw[:8].tobytes(), "little")
    if 8 + header_len > raw.size:
        raise ValueError("adapter payload is not in safetensors format (header runs past the end)")
    try:
        header = json.loads(raw[8 : 8 + header_len].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("adapter payload is not in safetensors format (bad header)") from None
    if not isinstance(header, dict):
        raise ValueError("adapter payload is not in safetensors format (bad header)")
    if torch.device(device).type == "cpu":
        data = torch.empty(raw.size, dtype=torch.uint8)
        copy_in_parallel(data.numpy(), raw)
    elif staging is not None:
        # pinned staging: a host memcpy plus a full-speed DMA beat one pageable transfer
        host = staging[: raw.size]
        copy_in_parallel(host.numpy(), raw)
        data = host.to(device, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()  # the next push refills `staging`
    else:
        with warnings.catch_warnings():  # read-only source: torch only reads it for the copy
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(raw).to(device)
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"adapter tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= raw.size - base:
            raise ValueError(f"adapter payload is not in safetensors format ({name} runs past the end)")
        tensors[name] = data[base + start : base + end].view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def write_payload(payload: np.ndarray, path: str | Path) -> None:
    """The payload as a safetensors file, written from its buffer (no copy of it first)."""
    Path(path).write_bytes(memoryview(payload))

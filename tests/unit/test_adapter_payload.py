"""The in-memory adapter format: valid safetensors, exact round trips, peft's names."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load

from shared.adapter_payload import copy_in_parallel, decode_adapter, encode_adapter


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(4, 6, generator=generator),
        "base_model.model.layers.0.q_proj.lora_B.weight": torch.randn(6, 4, generator=generator),
        "odd": torch.randn(3, generator=generator),  # an odd byte count must not misalign the next
        "base_model.model.layers.1.q_proj.lora_A.weight": torch.randn(4, 6, generator=generator),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_payload_is_a_safetensors_file_and_round_trips(dtype):
    tensors = _tensors()
    payload = encode_adapter(tensors, dtype)
    from_file = load(payload.tobytes())  # what a peft folder written from the payload holds
    decoded = decode_adapter(payload)
    for name, tensor in tensors.items():
        assert torch.equal(from_file[name], tensor.to(dtype))
        assert torch.equal(decoded[name], tensor.to(dtype))
    assert decode_adapter(payload.tobytes()).keys() == tensors.keys()  # the bytes route too


def test_decoded_tensors_own_their_memory():
    payload = encode_adapter(_tensors(), torch.float32)
    decoded = decode_adapter(payload)
    payload[:] = 0  # the sender's buffer may be reused or freed
    assert torch.equal(decoded["odd"], _tensors()["odd"])


@pytest.mark.parametrize("payload", [
    b"\x01\x02",
    b"\xff" * 8 + b"{}",
    (4).to_bytes(8, "little") + b"nope",
    (5).to_bytes(8, "little") + b"[1,2]",
    (57).to_bytes(8, "little") + b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}   ',
])
def test_garbage_payload_is_rejected_with_a_clear_error(payload):
    with pytest.raises(ValueError, match="safetensors"):
        decode_adapter(payload)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_staging_upload_is_exact_and_the_buffer_can_be_reused():
    staging = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    for seed in (0, 1):  # the second upload overwrites the staging buffer of the first
        tensors = _tensors(seed)
        decoded = decode_adapter(encode_adapter(tensors, torch.bfloat16), "cuda", staging)
        assert {k: v.device.type for k, v in decoded.items()} == {k: "cuda" for k in tensors}
        assert all(torch.equal(decoded[k].cpu(), v.to(torch.bfloat16)) for k, v in tensors.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_encoding_gpu_tensors_gives_the_same_bytes_as_cpu_tensors():
    tensors = _tensors()
    on_gpu = encode_adapter({k: v.cuda() for k, v in tensors.items()}, torch.bfloat16)
    assert on_gpu.tobytes() == encode_adapter(tensors, torch.bfloat16).tobytes()


def test_shared_memory_file_holds_the_payload_and_is_removed_even_on_error():
    from rollout_server.worker import shared_memory_file

    payload = encode_adapter(_tensors(), torch.float32)
    with pytest.raises(RuntimeError):
        with shared_memory_file(payload, "qerl-test-") as path:
            with open(path, "rb") as file:
                assert file.read() == payload.tobytes()
            assert decode_adapter(np.fromfile(path, dtype=np.uint8)).keys() == _tensors().keys()
            raise RuntimeError("the engine refused the adapter")
    assert not os.path.exists(path)


@pytest.mark.parametrize("size, threads", [(3 * 2**23 + 123, 3), (2**23 - 5, 4), (2**24, 1)])
def test_parallel_copy_copies_every_byte(size, threads):
    source = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    target = np.zeros_like(source)
    copy_in_parallel(target, source, threads)
    assert np.array_equal(target, source)

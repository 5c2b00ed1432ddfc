"""vLLM's LoRA shrink/expand Triton kernels, run under launch configs we choose (for `qerl bench
lora-kernels`). This touches vLLM internals (`_lora_shrink`/`_lora_expand`, `LoRAKernelMeta`,
`get_lora_op_configs`) the same way on vLLM 0.26 and 0.32; it is benchmark tooling, so it lives
here and not in the training run's engine extension.
"""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager

import torch


class LoraKernel:
    """One LoRA kernel call as vLLM makes it in a decode or prefill step: `op` "shrink"
    (x[tokens, fan_in] @ A -> buffer[slices, tokens, rank], fp32) or "expand" (buffer @ B added
    into y[tokens, sum(fan_outs)]), every token on the one adapter slot (max_loras=1)."""

    def __init__(self, op: str, tokens: int, fan_in: int, fan_outs: tuple[int, ...], rank: int):
        from vllm.lora.ops.triton_ops import lora_expand_op, lora_shrink_op
        from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

        self.op = op
        self.module = lora_shrink_op if op == "shrink" else lora_expand_op
        self._kernel = getattr(self.module, f"_lora_{op}")
        meta = LoRAKernelMeta.make(max_loras=1, max_num_tokens=tokens, device="cuda")
        meta.prepare_tensors(torch.zeros(tokens, dtype=torch.int32, device="cuda"))
        # 0.32 added specialize_active_lora; vLLM's default (off) pads the launch to max_loras + 1
        extra = {"specialize_active_lora": False} if "specialize_active_lora" in inspect.signature(
            meta.meta_args).parameters else {}
        self._meta = meta.meta_args(tokens, **extra)
        self._meta_keepalive = meta
        self._key: dict | None = None
        slices = len(fan_outs)
        generator = torch.Generator(device="cuda").manual_seed(0)

        def randn(*shape, dtype=torch.bfloat16):
            return (0.1 * torch.randn(*shape, generator=generator, device="cuda")).to(dtype)

        if op == "shrink":
            self.inputs = randn(tokens, fan_in)
            self.weights = [randn(1, rank, fan_in) for _ in fan_outs]
            self.output = torch.zeros(slices, tokens, rank, dtype=torch.float32, device="cuda")
        else:
            self.inputs = randn(slices, tokens, rank, dtype=torch.float32)
            self.weights = [randn(1, fan_out, rank) for fan_out in fan_outs]
            self.output = torch.zeros(tokens, sum(fan_outs), dtype=torch.bfloat16, device="cuda")

    def __call__(self) -> None:
        if self.op == "shrink":
            self._kernel(self.inputs, self.weights, self.output, *self._meta, 1.0)
        else:
            self._kernel(self.inputs, self.weights, self.output, *self._meta, offset_start=0, add_inputs=True)

    def lookup_key(self) -> dict:
        """The arguments vLLM looks this call's launch config up by, as its own call passes them
        (found by one launch, then kept)."""
        if self._key is None:
            seen: list[dict] = []
            with self.config(None, seen):
                self()
            self._key = seen[0]
        return self._key

    @contextmanager
    def config(self, chosen: dict | None, seen: list[dict] | None = None):
        """Within the block the kernel launches with `chosen` (None: vLLM's own choice); each
        lookup vLLM makes is appended to `seen` as its keyword arguments."""
        original = self.module.get_lora_op_configs

        def lookup(*args, **kwargs):
            if seen is not None:
                seen.append(dict(inspect.signature(original).bind(*args, **kwargs).arguments))
            return original(*args, **kwargs) if chosen is None else chosen

        self.module.get_lora_op_configs = lookup
        try:
            yield
        finally:
            self.module.get_lora_op_configs = original


def tuned_lora_config(folder: str, key: dict) -> dict:
    """The config vLLM's own loader finds for `key` in the files under `folder`."""
    from vllm.lora.ops.triton_ops import utils

    def forget_loaded_files() -> None:  # both lookups are lru-cached
        for cached in (getattr(utils, "load_lora_op_config", None), utils.get_lora_op_configs):
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()

    previous = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
    os.environ["VLLM_TUNED_CONFIG_FOLDER"] = folder
    forget_loaded_files()
    try:
        return dict(utils.get_lora_op_configs(**key))
    finally:
        if previous is None:
            os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None)
        else:
            os.environ["VLLM_TUNED_CONFIG_FOLDER"] = previous
        forget_loaded_files()

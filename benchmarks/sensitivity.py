"""`qerl bench sensitivity`: how far a one-ulp 16-bit difference upstream of the base layers
moves each learner's policy, with no engine in the loop.

An engine and its learner never compute every 16-bit value the same way: their attention
kernels differ (vLLM's FlashAttention against the learner's SDPA), and so may the place where a
norm rounds to 16 bits. A format whose base layers round their inputs again (W8A8: per-token fp8,
3 mantissa bits) can turn such a one-ulp difference into a whole fp8 step. This benchmark scores
the same tokens twice with one learner, in bf16 on any device, changing only one of those two
things between the passes:

- `attention`: SDPA, then PyTorch's eager attention (another kernel, other rounding);
- `norm`: HF's RMSNorm (rounds to bf16, then multiplies by the weight in bf16), then one rounding
  of the fp32 product.

Per format it reports the KL and |d| between the passes, estimated as `qerl bench fidelity` does
(`benchmarks.common.logprob_gap`). Their ratio to bf16's says how much a pair's engine-vs-learner
KL can grow over the bf16 pair's from differences no pair removes.
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from random import Random

import torch

from benchmarks.common import check_policy_formats, environment_facts, logprob_gap, print_table, write_json
from learner.actor import Learner, LearnerSpec, build_learner
from shared.config import LearnerConfig, LoraConfig, PolicyConfig, QerlConfig

PERTURBATIONS = ("attention", "norm")


@dataclass(frozen=True)
class SensitivityBenchArgs:
    formats: tuple[str, ...] = ("bf16", "w8a8")
    sequences: int = 64
    prompt_len: int = 12
    gen_len: int = 48
    json: str | None = None


@dataclass(frozen=True)
class _Bf16LearnerSpec(LearnerSpec):
    """A learner that computes in bf16 on a CPU too (it computes in fp32 there otherwise)."""

    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16


def bench_sensitivity(config: QerlConfig, args: SensitivityBenchArgs, log=print) -> dict:
    from learner.model import resolve_model_path

    check_policy_formats(args.formats)
    model_path = resolve_model_path(config.model.path, log)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"[qerl] bench sensitivity: {args.sequences} sequences of {args.prompt_len} + {args.gen_len} random "
        f"tokens, bf16 learners on {device}, perturbations {', '.join(PERTURBATIONS)}")
    rows = []
    for policy_format in args.formats:
        with tempfile.TemporaryDirectory(prefix="qerl-sensitivity-") as run_dir:
            learner = _learner(model_path, policy_format, config, run_dir, device)
            pairs = _random_pairs(args, learner.model.config.vocab_size, config.train.seed)
            for perturbation in PERTURBATIONS:
                rows.append({"format": policy_format, "perturbation": perturbation,
                             **_compare(learner, pairs, perturbation)})
                log(f"[qerl]   {policy_format} {perturbation}: KL mean {rows[-1]['kl_mean']:.2e}")
    reference = {r["perturbation"]: r["kl_mean"] for r in rows if r["format"] == "bf16"}
    for row in rows:
        row["kl_vs_bf16"] = row["kl_mean"] / reference[row["perturbation"]] if reference else None
    print_table(["format", "perturbation", "tokens", "KL mean", "vs bf16", "|d| mean", "|d| max"],
                [[r["format"], r["perturbation"], r["tokens"], f"{r['kl_mean']:.2e}",
                  f"{r['kl_vs_bf16']:.1f}x" if r["kl_vs_bf16"] is not None else "-", f"{r['abs_diff_mean']:.2e}",
                  f"{r['abs_diff_max']:.2e}"] for r in rows], log)
    result = {"benchmark": "sensitivity", "args": asdict(args), "config": config.model_dump(),
              "environment": environment_facts(), "device": device, "rows": rows}
    write_json(args.json, result, log)
    return result


def _learner(model_path: str, policy_format: str, config: QerlConfig, run_dir: str, device: str) -> Learner:
    """The pair's learner in bf16, eager layers, with a non-zero LoRA (so the adapter takes part)."""
    spec = _Bf16LearnerSpec(model_path, LoraConfig(rank=config.lora.rank, alpha=config.lora.alpha),
                            LearnerConfig(warmup_steps=0, compile_layers=False), run_dir,
                            PolicyConfig(format=policy_format), "bfloat16", config.train.seed, device)
    learner = build_learner(spec, log=lambda *_: None)
    generator = torch.Generator().manual_seed(config.train.seed)
    with learner.lora.edited() as params:
        for param in params:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return learner


def _random_pairs(args: SensitivityBenchArgs, vocab: int, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = Random(seed)
    tokens = range(3, vocab)
    return [([rng.choice(tokens) for _ in range(args.prompt_len)], [rng.choice(tokens) for _ in range(args.gen_len)])
            for _ in range(args.sequences)]


def _compare(learner: Learner, pairs: list[tuple[list[int], list[int]]], perturbation: str) -> dict:
    reference = learner.logprobs(pairs, 1.0)
    with _perturbed(learner.model, perturbation):
        perturbed = learner.logprobs(pairs, 1.0)
    return logprob_gap([a - b for row_a, row_b in zip(reference, perturbed) for a, b in zip(row_a, row_b)])


@contextmanager
def _perturbed(model, perturbation: str):
    """The model with one 16-bit rounding changed (PERTURBATIONS), restored on exit."""
    if perturbation == "attention":
        configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
        saved = {key: c._attn_implementation for key, c in configs.items()}
        for c in configs.values():
            c._attn_implementation = "eager"
        try:
            yield
        finally:
            for key, c in configs.items():
                c._attn_implementation = saved[key]
        return
    norm_class = type(next(m for m in model.modules() if type(m).__name__.endswith("RMSNorm")))
    hf_forward = norm_class.forward
    norm_class.forward = _rms_norm_one_rounding
    try:
        yield
    finally:
        norm_class.forward = hf_forward


def _rms_norm_one_rounding(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm with the weight applied in fp32 and one rounding to the input's dtype."""
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (x * self.weight.float()).to(hidden_states.dtype)

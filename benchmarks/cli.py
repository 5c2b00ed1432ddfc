"""`qerl bench ...`: the benchmarks' command line.

Every benchmark reads the same run config as `qerl train` (`--config FILE` plus
`section.key=value` overrides; without `--config`, the defaults of `shared/config.py`, which
fit the embedded tiny model on a CPU). The flags below are only what a benchmark sweeps or
writes; every rollout, LoRA and learner setting comes from the config, e.g.

    qerl bench rollout --config configs/bench_gpu.yaml --shape qwen2.5-7b --formats bf16,int4 \
        rollout.linear_backend=marlin
"""

from __future__ import annotations

import argparse

from benchmarks.shapes import SHAPE_NAMES

SHAPE_HELP = (f"random weights of a named shape ({', '.join(SHAPE_NAMES)}); "
              "default: the config's model.path (tiny when unset)")


def ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def at_least(minimum: int):
    """argparse type: an integer >= minimum (bad counts fail before any engine starts)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _output_folder(text: str) -> str:
    from pathlib import Path

    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return text


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML run config (default: shared/config.py's defaults)")
    parser.add_argument("--shape", choices=SHAPE_NAMES, default=None, help=SHAPE_HELP)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for qerl train")


def add_bench_parsers(bench: argparse.ArgumentParser) -> None:
    kinds = bench.add_subparsers(dest="bench", required=True)
    rollout = kinds.add_parser("rollout", help="vLLM rollout tok/s vs Hugging Face generate, by concurrency")
    _common(rollout)
    rollout.add_argument("--concurrency", type=ints, default=(16, 64, 256), help="sequences in flight, e.g. 16,64,256")
    rollout.add_argument("--prompt-len", type=at_least(1), default=None,
                         help="default 256, less where the model's context is shorter")
    rollout.add_argument("--gen-len", type=at_least(1), default=None,
                         help="default 512, less where the model's context is shorter")
    rollout.add_argument("--formats", type=lambda t: tuple(f for f in t.split(",") if f), default=(),
                         help="policy formats side by side, each on its own engine, e.g. bf16,int4,nvfp4 "
                              "(default: the config's policy.format); ratios are to the first")
    rollout.add_argument("--no-adapter", action="store_true", help="serve the bare base (no LoRA)")
    rollout.add_argument("--repeats", type=at_least(1), default=3,
                         help="timed vLLM runs per concurrency; the median is reported")
    rollout.add_argument("--peer-concurrency", type=ints, default=(16, 64), help="'' skips the HF peer")
    rollout.add_argument("--peer-gen-len", type=at_least(1), default=None,
                         help="tokens the peer generates (default: --gen-len; fewer is quicker but flatters the "
                              "peer, whose cost per token grows with length)")
    rollout.add_argument("--peer-format", default="nf4", choices=["nf4", "bf16", "fp32"])
    rollout.add_argument("--profile", metavar="DIR", type=_output_folder, default=None,
                         help="also profile one generate (device time by kernel kind, GPU busy share); op table in DIR")
    rollout.add_argument("--profile-seqs", type=at_least(1), default=64,
                         help="sequences in the profiled generate (whatever --concurrency sweeps)")
    sync = kinds.add_parser("sync", help="adapter push latency into rollout.num_workers workers: memory vs disk")
    _common(sync)
    sync.add_argument("--repeats", type=at_least(1), default=20)
    learner = kinds.add_parser("learner", help="learner step tok/s and peak memory by base format and micro-batch")
    _common(learner)
    learner.add_argument("--formats", default="nf4,bf16", type=lambda t: tuple(t.split(",")))
    learner.add_argument("--micro-batches", type=ints, default=(1, 4, 16))
    learner.add_argument("--prompt-len", type=at_least(1), default=None)
    learner.add_argument("--gen-len", type=at_least(1), default=None)
    learner.add_argument("--repeats", type=at_least(1), default=2)
    learner.add_argument("--profile", metavar="DIR", type=_output_folder, default=None,
                         help="also profile one step at the largest micro-batch (device time by kernel kind)")
    fidelity = kinds.add_parser("fidelity", help="KL(rollout||learner), |dlogprob| and rollout entropy per policy pair")
    _common(fidelity)
    fidelity.add_argument("--formats", type=lambda t: tuple(f for f in t.split(",") if f), default=(),
                          help="policy formats to compare (default: every one this machine serves)")
    fidelity.add_argument("--prompts", type=at_least(1), default=32, help="task prompts sampled per format")
    sensitivity = kinds.add_parser("sensitivity", help="KL from a one-ulp 16-bit difference (attention kernel, norm "
                                                       "rounding) per learner format, no engine")
    _common(sensitivity)
    sensitivity.add_argument("--formats", type=lambda t: tuple(f for f in t.split(",") if f),
                             default=("bf16", "w8a8"), help="learner formats; ratios to bf16 where it is one")
    sensitivity.add_argument("--sequences", type=at_least(1), default=64)
    sensitivity.add_argument("--prompt-len", type=at_least(1), default=12)
    sensitivity.add_argument("--gen-len", type=at_least(1), default=48)
    fleet = kinds.add_parser("fleet", help="rollout tok/s of 1, 2, 4... workers, adapter push included; dispatch")
    _common(fleet)
    fleet.add_argument("--workers", type=ints, default=(1, 2, 4), help="fleet sizes, e.g. 1,2,4")
    fleet.add_argument("--dispatch", type=lambda t: tuple(d for d in t.split(",") if d), default=("queue",),
                       help="queue and/or slices, each measured at every fleet size")
    fleet.add_argument("--slow-worker", type=float, default=1.0, metavar="FACTOR",
                       help="make worker 0 this many times slower per chunk (default 1: none)")
    fleet.add_argument("--steps", type=at_least(1), default=3, help="timed steps per fleet; the median is reported")
    fleet.add_argument("--prompt-len", type=at_least(1), default=None)
    fleet.add_argument("--gen-len", type=at_least(1), default=None)
    step = kinds.add_parser("step", help="the whole RL step (rollout, learner, sync) per policy format, as qerl "
                                         "train places it")
    _common(step)
    step.add_argument("--formats", type=lambda t: tuple(f for f in t.split(",") if f), default=(),
                      help="policy formats one after another, e.g. bf16,int4 (default: the config's); ratios to the "
                           "first")
    step.add_argument("--steps", type=at_least(1), default=3, help="timed steps per format, after one warm-up step")
    step.add_argument("--prompt-len", type=at_least(1), default=10)
    step.add_argument("--gen-len", type=at_least(1), default=256, help="completion length limit")
    step.add_argument("--lengths", choices=("fixed", "lognormal"), default="fixed",
                      help="every completion to --gen-len, or long-tailed lengths with a mean of a third of it")
    step.add_argument("--gpu-memory-gib", type=float, default=None,
                      help="stand in for a card of this size: the engines' and the learner's shares capped to it")
    step.add_argument("--profile", metavar="DIR", type=_output_folder, default=None,
                      help="after the timed steps, profile one more learner phase in the learner's process "
                           "(device time by kernel kind); op table in DIR/FORMAT")
    rebuild = kinds.add_parser("rebuild", help="the learner's packed 4-bit rebuild per weight shape vs compiled and "
                                               "eager references and the memory floor (GPU only)")
    _common(rebuild)
    rebuild.add_argument("--formats", type=lambda t: tuple(f for f in t.split(",") if f), default=("int4", "nvfp4"),
                         help="int4 and/or nvfp4")
    rebuild.add_argument("--repeats", type=at_least(1), default=50, help="calls timed per shape and rebuild")
    kernels = kinds.add_parser("lora-kernels", help="tune vLLM's LoRA kernels for a model shape on this GPU")
    _common(kernels)
    kernels.add_argument("--tokens", type=ints, default=(16, 32, 64, 128, 256, 512, 2048, 8192),
                         help="tokens per kernel call: decode batch sizes and prefill chunks")
    kernels.add_argument("--out", type=_output_folder, default="configs/lora-kernels",
                         help="folder for the config files (merged with those already there)")


def run_bench(args: argparse.Namespace) -> dict:
    """Load the config, then run the benchmark `args.bench` with its sweep flags."""
    from shared.config import load_config
    from shared.errors import QerlError

    config = load_config(args.config, args.overrides)
    sweep = {k: v for k, v in vars(args).items() if k not in ("command", "bench", "config", "overrides")}
    if args.bench == "rollout":
        from benchmarks.rollout import RolloutBenchArgs, bench_rollout

        return bench_rollout(config, RolloutBenchArgs(**sweep))
    if args.bench == "sync":
        from benchmarks.sync import SyncBenchArgs, bench_sync

        return bench_sync(config, SyncBenchArgs(**sweep))
    if args.bench in ("fidelity", "sensitivity") and sweep.pop("shape"):
        raise QerlError(f"qerl bench {args.bench} needs real weights: set model.path (or leave it unset for tiny)")
    if args.bench == "fidelity":
        from benchmarks.fidelity import FidelityBenchArgs, bench_fidelity

        return bench_fidelity(config, FidelityBenchArgs(**sweep))
    if args.bench == "sensitivity":
        from benchmarks.sensitivity import SensitivityBenchArgs, bench_sensitivity

        return bench_sensitivity(config, SensitivityBenchArgs(**sweep))
    if args.bench == "fleet":
        from benchmarks.fleet import FleetBenchArgs, bench_fleet

        return bench_fleet(config, FleetBenchArgs(**sweep))
    if args.bench == "lora-kernels":
        from benchmarks.lora_kernels import LoraKernelBenchArgs, bench_lora_kernels

        return bench_lora_kernels(config, LoraKernelBenchArgs(**sweep))
    if args.bench == "rebuild":
        from benchmarks.rebuild import RebuildBenchArgs, bench_rebuild

        return bench_rebuild(config, RebuildBenchArgs(**sweep))
    if args.bench == "step":
        from benchmarks.step import StepBenchArgs, bench_step

        return bench_step(config, StepBenchArgs(**sweep))
    from benchmarks.learner import LearnerBenchArgs, bench_learner

    return bench_learner(config, LearnerBenchArgs(**sweep))

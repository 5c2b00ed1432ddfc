"""The `qerl` command.

    qerl train --config configs/tiny_cpu.yaml [section.key=value ...]
    qerl bench rollout|sync|learner|lora-kernels [--model tiny|qwen2.5-7b|/path] [options]
"""

from __future__ import annotations

import argparse
import sys

from shared.errors import QerlError


class _OneLineErrors(argparse.ArgumentParser):
    """Bad arguments: one line naming the problem (argparse would print the usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="qerl", description="RL fine-tuning of LLMs on 4-bit bases (QeRL).")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run GRPO training with vLLM rollout workers on Ray")
    train.add_argument("--config", required=True, help="YAML run config (see configs/)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=10")
    _add_bench_parsers(commands.add_parser("bench", help="rollout, adapter-sync and learner benchmarks"))
    return parser


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _at_least(minimum: int):
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


def _folder(text: str) -> str:
    from shared.config import existing_folder

    try:
        return existing_folder(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _output_folder(text: str) -> str:
    from pathlib import Path

    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return text


ENGINE_CORES = ["in-process", "separate"]
ENGINE_CORE_HELP = "where vLLM's engine core runs: in the worker's process (rollout.in_process=true) or its own"


def _add_bench_parsers(bench: argparse.ArgumentParser) -> None:
    kinds = bench.add_subparsers(dest="bench", required=True)
    model_help = "'tiny', a shape (qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b: random weights) or a local model folder"
    rollout = kinds.add_parser("rollout", help="vLLM rollout tok/s vs Hugging Face generate, by concurrency")
    rollout.add_argument("--model", default="tiny", help=model_help)
    rollout.add_argument("--lora-rank", type=_at_least(0), default=32, help="0: no adapter")
    rollout.add_argument("--base-format", default="auto", choices=["auto", "fp32", "bf16", "fp8", "bitsandbytes"])
    rollout.add_argument("--concurrency", type=_ints, default=(16, 64, 256), help="sequences in flight, e.g. 16,64,256")
    rollout.add_argument("--prompt-len", type=_at_least(1), default=256)
    rollout.add_argument("--gen-len", type=_at_least(1), default=512)
    rollout.add_argument("--samples-per-prompt", type=_at_least(1), default=8)
    rollout.add_argument("--peer-concurrency", type=_ints, default=(16, 64), help="'' skips the HF peer")
    rollout.add_argument("--peer-gen-len", type=_at_least(1), default=None,
                         help="tokens the peer generates (default: --gen-len; fewer is quicker but flatters the "
                              "peer, whose cost per token grows with length)")
    rollout.add_argument("--peer-format", default="nf4", choices=["nf4", "bf16", "fp32"])
    rollout.add_argument("--repeats", type=_at_least(1), default=3,
                         help="timed vLLM runs per concurrency; the median is reported")
    rollout.add_argument("--gpu-memory-utilization", type=float, default=0.6, help="vLLM's share; the peer needs the rest")
    rollout.add_argument("--engine-core", default="in-process", choices=ENGINE_CORES, help=ENGINE_CORE_HELP)
    rollout.add_argument("--request-seeds", default=True, action=argparse.BooleanOptionalAction,
                         help="a sampling seed per request, as rollout.request_seeds (vLLM samples seeded "
                              "sequences one by one)")
    rollout.add_argument("--lora-kernel-configs", type=_folder, default=None,
                         help="tuned LoRA kernel configs, as rollout.lora_kernel_configs (qerl bench lora-kernels)")
    rollout.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="as rollout.kv_cache_dtype")
    rollout.add_argument("--profile", metavar="DIR", type=_output_folder, default=None,
                         help="also profile one generate (device time by kernel kind, GPU busy share); op table in DIR")
    rollout.add_argument("--profile-seqs", type=_at_least(1), default=64, help="sequences in the profiled generate")
    rollout.add_argument("--json", help="also write the results here")
    sync = kinds.add_parser("sync", help="adapter push latency into N workers: in memory vs from disk")
    sync.add_argument("--model", default="tiny", help=model_help)
    sync.add_argument("--lora-rank", type=_at_least(1), default=16)
    sync.add_argument("--workers", type=_at_least(1), default=2)
    sync.add_argument("--repeats", type=_at_least(1), default=20)
    sync.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    sync.add_argument("--engine-core", default="in-process", choices=ENGINE_CORES, help=ENGINE_CORE_HELP)
    sync.add_argument("--json")
    learner = kinds.add_parser("learner", help="learner step tok/s and peak memory, NF4 vs bf16, by micro-batch")
    learner.add_argument("--model", default="tiny", help=model_help)
    learner.add_argument("--formats", default="nf4,bf16", type=lambda t: tuple(t.split(",")))
    learner.add_argument("--micro-batches", type=_ints, default=(1, 4, 16))
    learner.add_argument("--prompt-len", type=_at_least(1), default=256)
    learner.add_argument("--gen-len", type=_at_least(1), default=512)
    learner.add_argument("--lora-rank", type=_at_least(1), default=32)
    learner.add_argument("--repeats", type=_at_least(1), default=2)
    learner.add_argument("--json")
    kernels = kinds.add_parser("lora-kernels", help="tune vLLM's LoRA kernels for a model shape on this GPU")
    kernels.add_argument("--model", default="qwen2.5-7b", help=model_help)
    kernels.add_argument("--lora-rank", type=_at_least(1), default=32)
    kernels.add_argument("--tokens", type=_ints, default=(16, 32, 64, 128, 256, 512, 2048, 8192),
                         help="tokens per kernel call: decode batch sizes and prefill chunks")
    kernels.add_argument("--out", type=_output_folder, default="configs/lora-kernels",
                         help="folder for the config files (merged with those already there)")
    kernels.add_argument("--json")


def _run_bench(args: argparse.Namespace) -> None:
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "bench")}
    if args.bench == "rollout":
        from rollout_server.bench import RolloutBenchArgs, bench_rollout

        bench_rollout(RolloutBenchArgs(**fields))
    elif args.bench == "sync":
        from rollout_server.bench import SyncBenchArgs, bench_sync

        bench_sync(SyncBenchArgs(**fields))
    elif args.bench == "lora-kernels":
        from rollout_server.lora_kernels import LoraKernelBenchArgs, bench_lora_kernels

        bench_lora_kernels(LoraKernelBenchArgs(**fields))
    else:
        from learner.bench import LearnerBenchArgs, bench_learner

        bench_learner(LearnerBenchArgs(**fields))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "bench":
            _run_bench(args)
            return 0
        from shared.config import load_config

        config = load_config(args.config, args.overrides)
        from deploy.train import train

        train(config)
    except QerlError as error:
        print(f"qerl: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

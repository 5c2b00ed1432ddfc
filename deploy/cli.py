"""The `qerl` command. Every subcommand reads a run config the same way: `--config FILE` plus
`section.key=value` overrides (YAML values).

    qerl train --config configs/tiny_cpu.yaml [section.key=value ...]
    qerl bench rollout|sync|learner|lora-kernels [--config FILE] [--shape NAME] [sweep flags] [overrides]
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
    # The entry point dispatches `qerl bench` to the benchmarks package; nothing else in the
    # production packages imports it.
    from benchmarks.cli import add_bench_parsers

    parser = _OneLineErrors(prog="qerl", description="RL fine-tuning of LLMs on 4-bit bases (QeRL).")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineErrors)
    train = commands.add_parser("train", help="run GRPO training with vLLM rollout workers on Ray")
    train.add_argument("--config", required=True, help="YAML run config (see configs/)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=10")
    bench = commands.add_parser("bench", help="rollout, adapter-sync, learner and LoRA-kernel benchmarks")
    add_bench_parsers(bench)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Overrides may come before, between or after the flags."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [token for token in extra if token.startswith("-") or "=" not in token]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from shared.config import load_config

        if args.command == "bench":
            from benchmarks.cli import run_bench

            run_bench(args)
            return 0
        config = load_config(args.config, args.overrides)
        from deploy.train import train

        train(config)
    except QerlError as error:
        print(f"qerl: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

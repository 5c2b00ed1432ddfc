"""The `qerl` command: `qerl train --config configs/tiny_cpu.yaml [section.key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from shared.errors import QerlError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qerl", description="RL fine-tuning of LLMs on 4-bit bases (QeRL).")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run GRPO training with vLLM rollout workers on Ray")
    train.add_argument("--config", required=True, help="YAML run config (see configs/)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=10")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from shared.config import load_config

        config = load_config(args.config, args.overrides)
        if args.command == "train":
            from deploy.train import train

            train(config)
    except QerlError as error:
        print(f"qerl: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

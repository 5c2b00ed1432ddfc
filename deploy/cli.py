"""The `qerl` command. `train` and `bench` read a run config the same way: `--config FILE` plus
`section.key=value` overrides (YAML values); `report` reads only finished or running run folders.

    qerl train --config configs/tiny_cpu.yaml [section.key=value ...]
    qerl train --resume RUN_DIR [train.steps=N ...]
    qerl eval (--config FILE | RUN_DIR) [--adapter PEFT_FOLDER] [section.key=value ...]
    qerl bench rollout|sync|learner|step|fidelity|fleet|lora-kernels [--config FILE] [--shape NAME] [flags]
               [overrides]
    qerl report RUN_DIR [RUN_DIR ...] [--out PNG]
    qerl scale RUN_DIR --workers N [--wait SECONDS]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

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
    train = commands.add_parser("train", help="run GRPO/DAPO training with vLLM rollout workers on Ray")
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="YAML run config (see configs/)")
    source.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    train.add_argument("--verbose", action="store_true",
                       help="show the actors' own output (vLLM, torch, Ray); otherwise it goes to RUN_DIR/logs/")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=10")
    evaluation = commands.add_parser("eval", help="greedy accuracy and pass@k of an adapter on held-out problems")
    evaluation.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                            help="a run folder: its config, and its final adapter (else its latest checkpoint's)")
    evaluation.add_argument("--config", help="YAML run config, with --adapter")
    evaluation.add_argument("--adapter", metavar="PEFT_FOLDER", help="the adapter to evaluate")
    evaluation.add_argument("--json", help="also write the results to this file")
    evaluation.set_defaults(overrides=[])
    report = commands.add_parser("report", help="plot runs' curves from their metrics.jsonl into one PNG")
    report.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run folders, overlaid")
    report.add_argument("--out", type=Path, metavar="PNG", help="default: <first RUN_DIR>/report.png")
    report.set_defaults(overrides=[])  # parse_args collects stray key=value tokens into overrides
    scale = commands.add_parser("scale", help="change the rollout fleet of a running training from its next step")
    scale.add_argument("run_dir", metavar="RUN_DIR", help="the folder of a running qerl train")
    scale.add_argument("--workers", type=int, required=True, metavar="N", help="rollout workers wanted (>= 1)")
    scale.add_argument("--wait", type=float, metavar="SECONDS",
                       help="how long to wait for the cluster to have room for new workers (default: the run's "
                            "ray.placement_timeout_s)")
    scale.set_defaults(overrides=[])
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
    if args.command == "eval":
        if args.run_dir and "=" in args.run_dir:  # an override, not a folder
            args.overrides, args.run_dir = [args.run_dir, *args.overrides], None
        if bool(args.run_dir) == bool(args.config):
            parser.error("eval takes a RUN_DIR or --config FILE (one of them)")
        if args.config and not args.adapter:
            parser.error("eval --config needs --adapter PEFT_FOLDER")
    if args.command == "train" and args.verbose:
        args.overrides.append("ray.log_to_driver=true")
    if args.command in ("report", "scale") and args.overrides:
        parser.error(f"{args.command} takes no section.key=value overrides: {' '.join(args.overrides)}")
    return args


class _StopOnSignal:
    """SIGINT/SIGTERM from the first second on unwind like Ctrl-C, so every clean-up runs (the
    training loop installs its own handler, which finishes the step first). While the heavy
    modules import, a signal is only noted: an import cut in half leaves a module that a later
    import trips over with a traceback."""

    def __init__(self):
        self.noted: str | None = None
        self.imported = False
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, self._handle)

    def _handle(self, number, frame) -> None:
        self.noted = signal.Signals(number).name
        if self.imported:
            raise KeyboardInterrupt(self.noted)

    def imports_done(self) -> None:
        self.imported = True
        if self.noted:
            raise KeyboardInterrupt(self.noted)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = _StopOnSignal() if args.command in ("train", "eval") else None
    try:
        if args.command == "report":  # no config: it reads the run folders only
            from deploy.report import report

            report(args.run_dirs, args.out)
            return 0
        if args.command == "scale":  # joins the run's Ray cluster; the run's driver applies it
            # Ray 2.60 clusters (local ones too) use token authentication, and Ray reads the mode
            # once, when it is imported
            os.environ.setdefault("RAY_AUTH_MODE", "token")
            from deploy.fleet_control import scale

            scale(args.run_dir, args.workers, args.wait)
            return 0
        from shared.config import load_config

        if args.command == "bench":
            from benchmarks.cli import run_bench

            run_bench(args)
            return 0
        if args.command == "eval":
            import deploy.train  # noqa: F401 - the heavy imports, before a signal may interrupt

            stop.imports_done()
            return _evaluate(args)
        from deploy.train import Stopped, resume, train

        stop.imports_done()

        try:
            if args.resume:
                resume(args.resume, args.overrides)
            else:
                train(load_config(args.config, args.overrides))
        except Stopped as stopped:
            print(f"qerl: {stopped}", file=sys.stderr)
            return stopped.exit_code
    except QerlError as error:
        print(f"qerl: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        # a library may re-raise the interrupt without its argument
        name = str(interrupt) if str(interrupt) in ("SIGINT", "SIGTERM") else (stop and stop.noted) or "SIGINT"
        print(f"qerl: stopped by {name}", file=sys.stderr)
        return 128 + signal.Signals[name].value
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    import json

    from deploy.evaluate import eval_adapter_folder, eval_config, format_eval_line, run_eval

    config = eval_config(args.run_dir, args.config, args.overrides)
    folder = eval_adapter_folder(args.run_dir, args.adapter)
    record = run_eval(config, folder)
    print(format_eval_line(record))
    if args.json:
        Path(args.json).write_text(json.dumps({"adapter": str(folder), **record}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Entry points: the `qerl` CLI and the Ray driver's training loop."""

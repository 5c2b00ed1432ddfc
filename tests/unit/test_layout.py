"""The tree's boundaries: production packages never import the benchmarks, and only the
engine-internals module imports vLLM internals."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
PRODUCTION = ("shared", "learner", "rollout_server", "deploy")
ENTRY_POINT = ROOT / "deploy" / "cli.py"  # dispatches `qerl bench` to the benchmarks package


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _production_files() -> list[Path]:
    return [path for package in PRODUCTION for path in sorted((ROOT / package).rglob("*.py"))]


def test_production_never_imports_benchmarks():
    offenders = {
        str(path.relative_to(ROOT)): sorted(n for n in _imports(path) if n.split(".")[0] == "benchmarks")
        for path in _production_files()
        if path != ENTRY_POINT
    }
    assert _production_files() and {k: v for k, v in offenders.items() if v} == {}


def test_only_the_engine_module_reaches_into_vllm_internals():
    public = {"vllm", "vllm.lora.request"}  # LLM, SamplingParams, TokensPrompt, LoRARequest
    offenders = {
        str(path.relative_to(ROOT)): sorted(n for n in _imports(path) if n.startswith("vllm.") and n not in public)
        for path in _production_files()
        if path.name != "vllm_internals.py"
    }
    assert {k: v for k, v in offenders.items() if v} == {}

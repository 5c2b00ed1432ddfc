"""The tree's boundaries: production packages never import the benchmarks, and only the
engine-internals module imports vLLM internals; and the docs match the tree."""

from __future__ import annotations

import ast
import re
import unicodedata
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


# The docs are kept true here: every path docs/architecture.md names exists, the README indexes
# every docs/ page, and every relative link in the README, BENCHMARKS.md and docs/ resolves, down
# to its #anchor (GitHub's heading slugs).
DOCS = ROOT / "docs"
# Backticked names that are paths in a run folder or the user's home, not in the repository.
OUTSIDE_THE_REPO = ("RUN_DIR/", "~/")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`([^`]+)`")
_PATH_LIKE = re.compile(r"^[\w.\-]+(/[\w.\-]*)*$")
_FILE_SUFFIXES = (".py", ".yaml", ".sh", ".md", ".toml", ".json", ".cfg")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (commands there are not links or headings)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: rendered text, lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    text = text.lower()
    kept = "".join(c for c in text if c.isalnum() or c in "-_ " or unicodedata.category(c).startswith("M"))
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(path.read_text()):
        match = _HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """Relative links of a markdown file whose file or #anchor does not exist."""
    broken = []
    for line in _prose_lines(path.read_text()):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{path.name}: {target} (no such heading in {linked.name})")
    return broken


def named_paths(path: Path) -> list[str]:
    """The repository paths a page names in backticks: a slash or a file suffix, no spaces."""
    names = []
    for line in _prose_lines(path.read_text()):
        for span in _CODE_SPAN.findall(line):
            if _PATH_LIKE.match(span) and ("/" in span or span.endswith(_FILE_SUFFIXES)) \
                    and not span.startswith(OUTSIDE_THE_REPO):
                names.append(span)
    return names


def test_architecture_doc_names_only_paths_that_exist():
    names = named_paths(DOCS / "architecture.md")
    missing = [name for name in names if not (ROOT / name).exists()]
    assert len(names) > 20 and missing == []


def test_readme_indexes_every_docs_page_and_only_those():
    linked = {target.split("#")[0] for target in _LINK.findall((ROOT / "README.md").read_text())}
    indexed = {Path(t).name for t in linked if t.startswith("docs/") and t.endswith(".md")}
    pages = {page.name for page in DOCS.glob("*.md")}
    assert pages and indexed == pages


def test_markdown_links_and_anchors_resolve():
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted(DOCS.glob("*.md"))]
    assert [problem for page in pages for problem in broken_links(page)] == []


def test_the_docs_checks_catch_what_they_check(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `qerl` heading: 4-bit × 2\n\n[ok](#a-qerl-heading-4-bit--2) [bad](#nope) "
                    "[gone](missing.md)\n\n```\n[in code](nowhere.md)\n```\n`rollout_server/nopool.py`\n")
    assert broken_links(page) == ["page.md: #nope (no such heading in page.md)", "page.md: missing.md (no such file)"]
    assert named_paths(page) == ["rollout_server/nopool.py"] and not (ROOT / "rollout_server/nopool.py").exists()

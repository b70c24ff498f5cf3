"""docs/layout.md lists the tree as it is: every module and folder of ``nmt`` exactly once, each
with its role, and each folder's ``__init__`` says its role in a docstring."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "nmt"
LAYOUT = ROOT / "docs" / "layout.md"
RESULTS = ROOT / "docs" / "results"
RESULTS_BYTES = 1_000_000  # docs/results holds summaries: tables, JSON summaries, overrides, a few plots
SUMMARY_KINDS = {".md", ".json", ".csv", ".yaml", ".png"}  # not logs, hypothesis texts or checkpoints
ENTRY = re.compile(r"^(nmt/\S*)\s+(\S.*)$")


def listed() -> dict[str, str]:
    entries: dict[str, str] = {}
    for number, line in enumerate(LAYOUT.read_text(encoding="utf-8").splitlines(), 1):
        if found := ENTRY.match(line):
            path, role = found.groups()
            assert path not in entries, f"docs/layout.md line {number}: {path} is listed twice"
            entries[path] = role
    return entries


def in_tree() -> set[str]:
    modules = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py") if "conf" not in p.parts}
    folders = {p.parent.relative_to(ROOT).as_posix() + "/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    return {m for m in modules if not m.endswith("/__init__.py") or m == "nmt/__init__.py"} | folders


def test_the_layout_page_lists_every_module_and_folder_of_the_tree():
    entries, tree = listed(), in_tree()
    assert not tree - set(entries), f"not in docs/layout.md: {sorted(tree - set(entries))}"
    assert not set(entries) - tree, f"in docs/layout.md but not in the tree: {sorted(set(entries) - tree)}"


def test_every_folder_says_its_role_in_its_init():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and doc.split("\n")[0].strip(), f"{init.relative_to(ROOT)}: no docstring giving the folder's role"


def test_the_tests_index_is_current():
    """tests/INDEX.md maps each module to the test files that exercise it (``python -m tests.index``)."""
    from tests.index import INDEX, index

    assert INDEX.read_text(encoding="utf-8") == index(), "tests/INDEX.md is stale: run python -m tests.index"


def test_no_script_edits_sys_path():
    """Scripts import nmt as installed (pip install -e .): one that puts the tree on sys.path
    could run another checkout's nmt than the one installed, and hides a broken install."""
    edits = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=|PYTHONPATH")
    found = [p.name for p in sorted((ROOT / "scripts").glob("*.py")) if edits.search(p.read_text(encoding="utf-8"))]
    assert not found, f"scripts that edit sys.path: {found}"


def results_files() -> list[Path]:
    """The files of docs/results git tracks (every file there outside a git checkout)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", str(RESULTS)], cwd=ROOT, capture_output=True,
                                check=True, timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        return [p for p in RESULTS.rglob("*") if p.is_file()]
    return [ROOT / name for name in listed if name and (ROOT / name).is_file()]


def test_docs_results_hold_summaries_under_1_mb():
    """docs/results is what the guides cite: summaries a reader opens, not a run's raw outputs."""
    files = results_files()
    assert files, "docs/results: no files found"
    total = sum(p.stat().st_size for p in files)
    biggest = sorted(files, key=lambda p: -p.stat().st_size)[:5]
    assert total < RESULTS_BYTES, (f"docs/results holds {total:,} bytes (at most {RESULTS_BYTES:,}); the biggest: "
                                   + ", ".join(f"{p.relative_to(ROOT)} ({p.stat().st_size:,})" for p in biggest))
    raw = sorted(str(p.relative_to(ROOT)) for p in files if p.suffix not in SUMMARY_KINDS)
    assert not raw, f"raw outputs in docs/results (keep summaries: {', '.join(sorted(SUMMARY_KINDS))}): {raw}"

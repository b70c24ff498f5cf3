"""Which test files test which module of ``nmt``: a file tests a module when it is named for it
(``test_<module>.py``), imports it, or names it as a command runs it (``python -m nmt.x``,
``"nmt.x"``, or ``translate.py`` for the command scripts). ``tests/INDEX.md`` is this map, written by ``python -m tests.index`` and checked
by ``tests/test_layout.py``, so a reader finds a module's tests by its name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "tests" / "INDEX.md"
SCRIPTS = {"train.py": "nmt.train", "translate.py": "nmt.translate", "evaluate.py": "nmt.evaluate", "distill.py": "nmt.distill"}
HEADER = ("# Tests by module\n\nWhich test files exercise each module of `nmt`: named for it, importing it, or "
          "running it as a command (none: reached only through other modules). Written by `python -m tests.index`; "
          "`tests/test_layout.py` checks it is current.\n\n| module | test files |\n|---|---|\n")


def modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "nmt").rglob("*.py")):
        if "conf" in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def tested(source: str, known: set[str]) -> set[str]:
    """The modules of ``known`` one test file imports or names as a command."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found |= set(re.findall(r"\bnmt(?:\.\w+)+", node.value))
            found |= {module for script, module in SCRIPTS.items() if re.search(rf"(^|[\s/]){re.escape(script)}\b", node.value)}
    return {name for name in found if name in known and name != "nmt"}


def index() -> str:
    known = set(modules())
    by_module: dict[str, list[str]] = {name: [] for name in sorted(known)}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        named = {name for name in known if name.rsplit(".", 1)[-1] == path.stem.removeprefix("test_")}
        for name in sorted(tested(path.read_text(encoding="utf-8"), known) | named):
            by_module[name].append(path.name)
    rows = [f"| `{name}` | {', '.join(files) if files else 'none'} |" for name, files in by_module.items() if name != "nmt"]
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    INDEX.write_text(index(), encoding="utf-8")
    print(f"wrote {INDEX}")

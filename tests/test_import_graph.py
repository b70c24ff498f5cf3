"""The package's import graph: no circle, and every import goes down the layers (library modules
never import a command-line module; data code reads no checkpoint). Read from the source with
``ast``, function-level imports included, so a lazy import cannot hide a circle. And the
CTranslate2 path of the commands imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nmt"

# Layers by folder: lower numbers are lower layers; a module may import only modules of lower
# layers, or of its own folder (nmt.inference.* among themselves, ...). The top level holds the
# commands and the few modules every layer needs; ``nmt.languages`` the facts of languages they all read.
BASE = ["nmt", "nmt.specials", "nmt.text_lines", "nmt.cli_io", "nmt.machine"]
COMMANDS = ["nmt.train", "nmt.translate", "nmt.evaluate", "nmt.export", "nmt.average", "nmt.runs_table",
            "nmt.import_model"]
LAYERS = {
    0: [*BASE, "nmt.languages*", "nmt.runs*", "nmt.kernels*"],
    1: ["nmt.data*", "nmt.models*"],
    2: ["nmt.decoding*", "nmt.checkpoints*"],
    3: ["nmt.inference*"],
    4: ["nmt.evaluation*", "nmt.exporters*"],
    5: ["nmt.training*"],
    6: [*COMMANDS, "nmt.serve*"],  # the server is a command too (nmt-serve)
    7: ["nmt.study", "nmt.distill", "nmt.prune"],  # they run training (the study also writes evaluate's comparison),
    # or evaluate's split loading (nmt-prune)
    8: ["nmt.bench*"],  # what scripts/ shares: it may import any of nmt, and nothing in nmt imports it
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in out if m in known and m != name}


def layer(name: str) -> int:
    for number, names in LAYERS.items():
        if any(name == n or (n.endswith("*") and (name == n[:-1] or name.startswith(n[:-1] + "."))) for n in names):
            return number
    raise AssertionError(f"{name} has no layer in tests/test_import_graph.py: add it to LAYERS")


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_no_import_circle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for other in sorted(edges[name]):
            assert state.get(other) != 1, "import circle: " + " -> ".join(path[path.index(other):] + [other])
            if other not in state:
                visit(other)
        path.pop()
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name)


def subpackage(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_imports_go_down_the_layers():
    wrong = []
    for name, targets in graph().items():
        for target in targets:
            if target == "nmt":
                continue
            down = layer(target) < layer(name)
            inside = layer(target) == layer(name) and subpackage(target) == subpackage(name) and name not in BASE + COMMANDS
            if not (down or inside):
                wrong.append(f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_data_code_reads_no_checkpoint():
    for name, targets in graph().items():
        if name.startswith("nmt.data"):
            allowed = ("nmt.data", "nmt.languages")
            assert not {t for t in targets if not t.startswith(allowed) and t not in BASE}, name


def test_the_commands_import_no_torch_until_a_torch_model_is_opened():
    code = ("import sys, nmt.translate, nmt.serve.app, nmt.inference.backends, nmt.inference.ctranslate2, nmt.decoding.settings; "
            "from nmt.inference import CTranslate2Translator; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

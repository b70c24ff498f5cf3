"""Another revision of ``nmt`` beside this tree's, in one process (``scripts/benchmark_revisions.py``):
its ``nmt/``, extracted with ``git archive``, imported as the package ``nmt_before``."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

from nmt.bench import checkout


def extract(revision: str, into: Path) -> None:
    """``revision``'s ``nmt/`` as the package ``nmt_before`` under ``into``."""
    archive = subprocess.run(["git", "archive", revision, "nmt"], cwd=checkout(), check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        tarfile.open(fileobj=f).extractall(into, filter="data")
    (into / "nmt").rename(into / "nmt_before")
    for path in (into / "nmt_before").rglob("*.py"):
        path.write_text(re.sub(r"\b(from|import) nmt\b", r"\1 nmt_before", path.read_text()))


def import_revision(revision: str, into: Path) -> ModuleType:
    """``revision``'s ``nmt/`` extracted under ``into`` and imported as the package ``nmt_before``;
    ``import nmt_before.lit_module`` and its config targets then find its modules there."""
    extract(revision, into)
    init = into / "nmt_before" / "__init__.py"
    spec = importlib.util.spec_from_file_location("nmt_before", init, submodule_search_locations=[str(init.parent)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["nmt_before"] = package  # before running it, as the import system does: its modules import it
    spec.loader.exec_module(package)
    return package

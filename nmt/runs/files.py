"""The files of a run folder, named in one place and read back here: ``summary.json`` (written by
``nmt.train``), the test report ``bleu_by_length.{json,png,...}`` (``nmt.evaluation.length_report``), the
test's sources and hypotheses, the ``checkpoints/`` folder, and ``wall_seconds.json``, written
by :func:`run_timed` for a command timed from start to exit. The commands that tabulate runs
(``nmt-runs``, ``nmt-study``) and the scripts (``first_runs.py``, ``reproduce_results.py``) read
runs through it."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any

SUMMARY = "summary.json"
REPORT_STEM = "bleu_by_length"  # the test report: <stem>.json, .png, .md, .csv
REPORT = f"{REPORT_STEM}.json"
WALL = "wall_seconds.json"
CHECKPOINTS = "checkpoints"  # the run's checkpoints, last.ckpt among them
TEST_TEXT = "test_{}.txt"  # the test's sources, hypotheses, references: TEST_TEXT.format("sources"), ...("hyps"), ...("refs")


def json_text(value: Any) -> str:
    """``value`` as strict JSON, indented, with NaN and infinities (a confidence interval that was
    not computed, a metric of an empty bucket) written as null: every JSON reader accepts it."""
    def finite(node: Any) -> Any:
        if isinstance(node, float):
            return node if math.isfinite(node) else None
        if isinstance(node, dict):
            return {k: finite(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [finite(v) for v in node]
        return node

    return json.dumps(finite(value), indent=2, allow_nan=False) + "\n"


def read_text_lines(run_dir: Path, name: str) -> list[str]:
    """The lines of the run's own text file ``name`` (written by nmt, one sentence per line)."""
    return (Path(run_dir) / name).read_text(encoding="utf-8").split("\n")[:-1]


def read(run_dir: Path, name: str) -> dict:
    """The JSON file ``name`` of the run folder ``run_dir``."""
    return json.loads((Path(run_dir) / name).read_text())


def bucket_bleu(report: dict) -> dict[str, float]:
    """BLEU per source-length bucket of a test report, by label (``1-10``, ...), in the report's
    order; empty buckets are left out."""
    return {b["label"]: b["bleu"] for b in report["buckets"] if b["bleu"] is not None}


def value_at(data: Any, key: list) -> Any:
    """The value at ``key`` in nested JSON data. A string or an int indexes a dict or a list; a
    one-entry dict ``{field: value}`` picks the first list item whose ``field`` is ``value``, e.g.
    ``["buckets", {"label": "51-60"}, "bleu"]``. KeyError names the part that is missing."""
    for part in key:
        if isinstance(part, dict):
            ((field, wanted),) = part.items()
            found = [item for item in data if isinstance(item, dict) and str(item.get(field)) == str(wanted)]
            if not found:
                raise KeyError(f"no item with {field}={wanted}")
            data = found[0]
        elif isinstance(data, list):
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            raise KeyError(f"no {part!r}")
    return data


def run_timed(command: list[str], run_dir: Path, log: Path, shown: str, cwd: Path, env: dict | None = None,
              facts: dict | None = None) -> float:
    """Run ``command`` in ``cwd`` to its exit, its output into ``log``, and write
    ``run_dir/wall_seconds.json``: ``shown`` (the command as a user types it), the seconds from
    start to exit, which it returns, and ``facts`` about the machine (its CPU: a time means little
    without it). ``subprocess.CalledProcessError`` if the command fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as out:
        subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, check=True)
    seconds = time.perf_counter() - start
    (run_dir / WALL).write_text(json.dumps({**(facts or {}), "command": shown, "wall_seconds": round(seconds, 1)}) + "\n")
    return seconds


def system_name(ckpt: Path) -> str:
    """A checkpoint's name in a comparison: ``<run>/checkpoints/x.ckpt`` -> the run folder's name, or
    the task's for a run under ``<task>/runs/`` or ``<task>/multiruns/``."""
    run = ckpt.parent.parent
    return run.parent.parent.name if run.parent.name in ("runs", "multiruns") else run.name

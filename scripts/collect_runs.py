"""Collect the runs of a multirun folder into one table sorted by a metric.

    python scripts/collect_runs.py outputs/train/multiruns/<time> [--metric val/bleu_best]

Reads every ``*/summary.json`` under the folder and writes ``runs.csv`` and ``runs.md`` there.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any


def collect(folder: Path, metric: str = "val/bleu_best") -> list[dict[str, Any]]:
    """One row per finished run: its overrides, size, throughput, time and metrics, best first."""
    rows = []
    for path in sorted(folder.rglob("summary.json")):
        summary = json.loads(path.read_text())
        rows.append({
            "run": str(path.parent.relative_to(folder)),
            "overrides": " ".join(summary.get("overrides", [])),
            "parameters": summary["parameters"],
            "train_tokens_per_sec": summary["train_tokens_per_sec"],
            "fit_minutes": round(summary["fit_seconds"] / 60, 2),
            "steps": summary["steps"],
            **{k: round(v, 3) for k, v in sorted(summary["metrics"].items()) if k.split("/")[0] in ("val", "test")},
        })
    if not rows:
        raise SystemExit(f"no summary.json under {folder}: no run there has finished")
    missing = -math.inf
    rows.sort(key=lambda r: r.get(metric, missing) if r.get(metric) == r.get(metric) else missing, reverse=True)
    return rows


def write(rows: list[dict[str, Any]], folder: Path, metric: str) -> tuple[Path, Path]:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    csv_path, md_path = folder / "runs.csv", folder / "runs.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    shown = ["run", "overrides", metric, "test/bleu", "parameters", "train_tokens_per_sec", "fit_minutes"]
    shown = [k for k in dict.fromkeys(shown) if k in keys]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in shown) + " |" for row in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--metric", default="val/bleu_best")
    args = parser.parse_args()
    rows = collect(args.folder, args.metric)
    _, md_path = write(rows, args.folder, args.metric)
    print(md_path.read_text())


if __name__ == "__main__":
    main()

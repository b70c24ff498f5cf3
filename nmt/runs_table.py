"""nmt-runs: the runs of a multirun (or sweep) folder in one table sorted by a metric.

    nmt-runs outputs/train/multiruns/<time> [--metric val/bleu_best]

Reads every ``summary.json`` under the folder (``nmt.runs.files.SUMMARY``) and writes ``runs.csv``
and ``runs.md`` there.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from typing import Any

from nmt.runs.files import SUMMARY, read


def collect(folder: Path, metric: str = "val/bleu_best") -> list[dict[str, Any]]:
    """One row per finished run: its overrides, size, throughput, time and metrics, best first."""
    rows = []
    for path in sorted(folder.rglob(SUMMARY)):
        try:
            summary = read(path.parent, SUMMARY)
            rows.append({
                "run": str(path.parent.relative_to(folder)),
                "overrides": " ".join(summary.get("overrides", [])),
                "parameters": summary["parameters"],
                "train_tokens_per_sec": summary["train_tokens_per_sec"],
                "fit_minutes": round(summary["fit_seconds"] / 60, 2),
                "steps": summary["steps"],
                "max_steps": summary.get("max_steps"),
                "ended_by": summary.get("ended_by"),
                **{k: round(v, 3) for k, v in sorted(summary["metrics"].items()) if k.split("/")[0] in ("val", "test")},
            })
        except ValueError as error:  # json.JSONDecodeError included
            raise SystemExit(f"nmt-runs: {path}: not JSON ({error})") from None
        except (KeyError, AttributeError, TypeError) as error:
            raise SystemExit(f"nmt-runs: {path}: not a run summary (no {error})") from None
    if not rows:
        raise SystemExit(f"nmt-runs: no {SUMMARY} under {folder}: no run there has finished")
    if not any(metric in row for row in rows):
        metrics = sorted({k for row in rows for k in row if "/" in k})
        raise SystemExit(f"nmt-runs: no run has the metric '{metric}' (they have: {', '.join(metrics)})")
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
    shown = ["run", "overrides", metric, "test/bleu", "steps", "ended_by", "parameters", "train_tokens_per_sec", "fit_minutes"]
    shown = [k for k in dict.fromkeys(shown) if k in keys]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in shown) + " |" for row in rows]
    if saved := pruning_saved(rows):
        lines += ["", saved]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def pruning_saved(rows: list[dict[str, Any]]) -> str | None:
    """What pruning saved a sweep, in steps (the same on any machine), or None if no run was pruned."""
    pruned = [row for row in rows if row.get("ended_by") == "pruned"]
    budgets = [row.get("max_steps") for row in rows]
    if not pruned or not all(isinstance(b, int) and b > 0 for b in budgets):
        return None
    trained, budget = sum(row["steps"] for row in rows), sum(budgets)
    return (f"pruned: {len(pruned)} of {len(rows)} runs; {trained:,} of {budget:,} budgeted steps trained "
            f"({100 * (1 - trained / budget):.0f}% saved)")


def main() -> None:
    parser = argparse.ArgumentParser(prog="nmt-runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a multirun folder, e.g. outputs/train/multiruns/<time>")
    parser.add_argument("--metric", default="val/bleu_best", help="the column to sort by, best first")
    args = parser.parse_args()
    if not args.folder.is_dir():
        raise SystemExit(f"nmt-runs: {args.folder}: no such folder")
    rows = collect(args.folder, args.metric)
    _, md_path = write(rows, args.folder, args.metric)
    print(md_path.read_text())


if __name__ == "__main__":
    main()

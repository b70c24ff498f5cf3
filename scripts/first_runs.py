"""The first run of each preset, as a new user starts it: ``python train.py model=<m>`` on the
default data and settings, one after another, each timed from start to exit (start-up, training,
test), then one table of wall time, steps and test BLEU by source length.

    python scripts/first_runs.py                               # the four presets -> outputs/first_runs/
    python scripts/first_runs.py --models transformer --out docs/results/first_runs
    python scripts/first_runs.py --collect outputs/first_runs  # the table of finished runs again
    python scripts/first_runs.py --busy --out outputs/first_runs_busy   # beside one CPU-bound process

Each run goes to ``<out>/<model>/`` (Hydra's run folder); ``<out>/first_runs.{md,json}`` hold
the table. Extra arguments are overrides for every run (e.g. ``seed=2``). ``--busy`` runs each
command beside one competing CPU-bound process (``yes > /dev/null``, as a second job on a
developer's machine would be): a run's budget is in steps, so it should end later with the same
result.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from nmt.machine import cpu_name
from nmt.runs.files import REPORT, SUMMARY, WALL, bucket_bleu, read, run_timed

MODELS = ("lstm", "lstm_bahdanau", "lstm_luong", "transformer")


COMPETITOR = "competitor.json"  # in a run folder: the process it ran beside


def run(model: str, out: Path, overrides: list[str], busy: bool = False) -> float:
    """Train ``model`` into ``out/model``, beside ``yes > /dev/null`` if ``busy``; the seconds
    from start to exit."""
    command = [sys.executable, "train.py", f"model={model}", *overrides, f"hydra.run.dir={out / model}"]
    (out / model).mkdir(parents=True, exist_ok=True)
    (out / model / COMPETITOR).unlink(missing_ok=True)
    competitor = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if busy else None
    try:
        seconds = run_timed(command, out / model, out / f"{model}.log", " ".join(command[1:-1]), cwd=ROOT,
                            facts={"cpu": cpu_name()})
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    if busy:
        (out / model / COMPETITOR).write_text(json.dumps({"competitor": "yes > /dev/null"}) + "\n")
    return seconds


def row(run_dir: Path) -> dict:
    """One run's numbers from its ``summary.json``, ``bleu_by_length.json`` and wall time."""
    summary, report, wall = read(run_dir, SUMMARY), read(run_dir, REPORT), read(run_dir, WALL)
    buckets = bucket_bleu(report)
    first, last = next(iter(buckets)), list(buckets)[-1]
    return {"model": run_dir.name, "command": wall["command"], "wall_seconds": wall["wall_seconds"],
            "busy": (run_dir / COMPETITOR).is_file(), "tgt_tokens_per_sec": summary.get("train_tgt_tokens_per_sec"),
            "precision": summary["hardware"]["precision"], "steps": summary["steps"], "bleu": report["bleu"],
            "buckets": buckets, "drop": buckets[first] - buckets[last], "first": first, "last": last}


def table(rows: list[dict]) -> str:
    labels = list(rows[0]["buckets"])
    lines = ["| command | machine | wall time | precision | target tokens/s | steps | test BLEU | " + " | ".join(labels)
             + f" | {labels[0]} -> {labels[-1]} |",
             "|---|---|---:|---|---:|---:|---:|" + "---:|" * len(labels) + "---:|"]
    for r in rows:
        minutes, seconds = divmod(round(r["wall_seconds"]), 60)
        cells = " | ".join(f"{r['buckets'][label]:.1f}" for label in labels)
        rate = f"{r['tgt_tokens_per_sec']:,.0f}" if r.get("tgt_tokens_per_sec") else "-"
        machine = "busy (`yes`)" if r.get("busy") else "quiet"
        lines.append(f"| `python {r['command']}` | {machine} | {minutes}:{seconds:02d} | {r['precision']} | {rate} | "
                     f"{r['steps']:,} | {r['bleu']:.1f} | {cells} | {-r['drop']:+.1f} |")
    return "\n".join(lines) + "\n"


def collect(out: Path, models: list[str]) -> str:
    rows = [row(out / m) for m in models if (out / m / WALL).is_file()]
    if not rows:
        raise SystemExit(f"{out}: no finished first run (<model>/wall_seconds.json) to collect")
    md = table(rows)
    (out / "first_runs.md").write_text(md)
    (out / "first_runs.json").write_text(json.dumps(rows, indent=2) + "\n")
    return md


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--out", type=Path, default=Path("outputs/first_runs"))
    parser.add_argument("--collect", type=Path, help="only tabulate the finished runs in this folder")
    parser.add_argument("--busy", action="store_true", help="run each command beside one CPU-bound process")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every run")
    args = parser.parse_args()
    out = (args.collect or args.out).resolve()
    if not args.collect:
        for model in args.models:
            seconds = run(model, out, args.overrides, busy=args.busy)
            print(f"{model}: {seconds:.0f} s", flush=True)
    print(collect(out, args.models), end="")


if __name__ == "__main__":
    main()

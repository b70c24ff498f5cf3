"""Validation's share of a training run's time, read from the runs' logs.

    python scripts/benchmark_validation.py RUN_DIR [RUN_DIR ...] [--out FILE.json]

Each RUN_DIR is the folder of a ``train.py`` run (its ``train.log`` and ``summary.json``). The log
has one line per validation ("validation at step N: BLEU b, k sentences in s s"); the summary the
time ``trainer.fit`` took (``fit_seconds``: training steps and the validations between them), and,
where training validated on a sample (``data.val_sample``), the final validation on every pair
after it, which this script counts too. The share is validation seconds over fit seconds plus that
final validation. The runs to compare, for example on Europarl it-en (3,000 development pairs):

    python train.py model=transformer data=files data.source.path=$DATA/europarl-it-en \\
        data.src_lang=it data.tgt_lang=en test=false data.val_sample=null hydra.run.dir=runs/full
    python train.py model=transformer data=files data.source.path=$DATA/europarl-it-en \\
        data.src_lang=it data.tgt_lang=en test=false hydra.run.dir=runs/sample
    python scripts/benchmark_validation.py runs/full runs/sample
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

LINE = re.compile(r"validation at step (\d+): BLEU ([\d.]+), (\d+) sentences in ([\d.]+) s")


def validations(log: str) -> list[dict]:
    """Each validation line of a run's log: step, BLEU, sentences, seconds."""
    return [{"step": int(m[1]), "bleu": float(m[2]), "sentences": int(m[3]), "seconds": float(m[4])}
            for m in LINE.finditer(log)]


def share(run: Path) -> dict:
    """Validation seconds, the run's fit seconds and the share, from ``run``'s log and summary."""
    summary = json.loads((run / "summary.json").read_text())
    runs = validations((run / "train.log").read_text())
    steps = summary["steps"]
    # the validation on every pair after fit (after one on a sample at the same step), if any
    final = runs[-1:] if len(runs) > 1 and runs[-1]["step"] == runs[-2]["step"] and \
        runs[-1]["sentences"] > runs[-2]["sentences"] else []
    seconds = sum(r["seconds"] for r in runs)
    total = summary["fit_seconds"] + sum(r["seconds"] for r in final)
    return {"run": str(run), "steps": steps, "validations": runs, "validation_seconds": round(seconds, 1),
            "fit_seconds": summary["fit_seconds"], "run_seconds": round(total, 1),
            "share": round(seconds / total, 3), "final_bleu": runs[-1]["bleu"] if runs else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here too")
    args = parser.parse_args()
    rows = [share(run) for run in args.runs]
    print("| run | validations (sentences each) | validation s | training + validation s | share | final val BLEU |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        sizes = ", ".join(str(v["sentences"]) for v in r["validations"])
        print(f"| {r['run']} | {len(r['validations'])} ({sizes}) | {r['validation_seconds']:,.1f} | "
              f"{r['run_seconds']:,.1f} | {100 * r['share']:.1f}% | {r['final_bleu']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()

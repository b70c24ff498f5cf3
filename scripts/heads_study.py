"""The attention-heads study (``docs/studies/attention_heads.md``): what each head of a trained
Transformer does, the BLEU as heads are pruned by importance, and how much a short fine-tuning
of each pruned model wins back.

    python scripts/heads_study.py --ckpt <run>/checkpoints/last.ckpt --runs outputs/heads_study
    python scripts/heads_study.py --ckpt ... --synthetic-ckpt <first-run Transformer>.ckpt --out docs/results/attention_heads

Steps, each skipped where its folder under ``--runs`` is finished (so the study can be resumed):

1. ``table_multi30k/``: ``nmt-evaluate heads=true`` on the checkpoint's test split (the per-head
   table, ``docs/evaluating.md``); ``table_synthetic/`` the same for ``--synthetic-ckpt`` (whose
   gold alignments give each cross-attention head's AER).
2. ``prune/``: ``nmt-prune`` at ``--levels`` (importance on the validation split).
3. ``finetune_<pct>/``: each level's pruned model fine-tuned with ``init_from`` for
   ``--steps`` steps of its experiment (``--experiment``) at learning rate ``--lr`` (level 0, the
   unpruned model, is the control: what the same extra training gives without pruning).
4. ``compare/``: ``nmt-evaluate`` on every level's translations before and after, paired
   against the unpruned model before fine-tuning.

Then ``--out`` gets ``study.md`` and ``study.json``: the head roles (counts of heads whose
statistics pass the thresholds below), and the pruning curve before and after fine-tuning.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from nmt.runs.files import json_text

KINDS = {"encoder": "encoder self-attention", "decoder": "decoder self-attention", "cross": "cross-attention"}
POSITIONAL = 0.5  # a positional head: at least this share of its weight on one of previous/same/next
CONFIDENT = 0.8  # a confident head: its mean largest weight at least this
RARE_FACTOR = 2.0  # a rare-piece head: a rare share at least this times its kind's median


def run(command: list[str], folder: Path, log: Path) -> None:
    """``command`` from the repository root unless ``folder`` holds its finished output."""
    done = folder / ".done"
    if done.is_file():
        return
    print(" ".join(command), flush=True)
    with log.open("w") as out:
        subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=True)
    done.write_text("")


def roles(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Per kind: heads, and how many are positional (previous, same or next), confident, or rare-piece heads."""
    out = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        rare = sorted(r["rare"] for r in mine)
        median = rare[len(rare) // 2]
        counts = {"heads": len(mine), "confident": sum(r["confidence"] >= CONFIDENT for r in mine),
                  "rare": sum(r["rare"] >= RARE_FACTOR * median for r in mine)}
        for where in ("previous", "same", "next"):
            if mine[0][where] is not None:
                counts[where] = sum(r[where] >= POSITIONAL for r in mine)
        out[kind] = counts
    return out


def heads_of(folder: Path) -> list[dict]:
    (path,) = folder.glob("*/heads.json")
    return json.loads(path.read_text())["heads"]


def scored(report: dict | None) -> dict | None:
    """A system of the comparison: BLEU, its interval, chrF, BLEU per length bucket and the paired
    difference from the full model over all sentences (None for the full model itself)."""
    if report is None:
        return None
    rows = (report.get("significance") or {}).get("rows", [])
    paired = next((r for r in rows if r["bucket"] == "all"), None)
    return {"bleu": round(report["bleu"], 2), "bleu_ci": [round(v, 2) for v in report["bleu_ci"]],
            "chrf": round(report["chrf"], 2), "by_length": {b["label"]: b["bleu"] for b in report["buckets"]},
            "delta_vs_full": None if paired is None else {k: paired[k] for k in ("delta", "delta_ci_low", "delta_ci_high",
                                                                                  "p_bootstrap", "p_randomization")}}


def collect(runs: Path, levels: list[int]) -> dict:
    """Head roles per model (the tables stay in each ``table_*`` folder) and each level before and after fine-tuning."""
    study: dict = {"roles": {}, "levels": []}
    for name in ("multi30k", "synthetic"):
        if (runs / f"table_{name}" / ".done").is_file():
            study["roles"][name] = roles(heads_of(runs / f"table_{name}"))
    pruning = json.loads((runs / "prune" / "pruning.json").read_text())
    systems = json.loads((runs / "compare" / "comparison.json").read_text())  # {system: its report}
    for row, pct in zip(pruning["levels"], levels):
        study["levels"].append({"pruned": pct, "heads": row["heads"], "of": row["of"], "parameters": row["parameters"],
                                "speed_vs_full": row["speed_vs_full"], "before": scored(systems[f"pruned_{pct:02d}"]),
                                "after": scored(systems.get(f"finetuned_{pct:02d}"))})
    return study


def markdown(study: dict) -> str:
    lines = []
    for name, kinds in study["roles"].items():
        lines += [f"### Head roles: {name}", "", "| attention | heads | confident | previous | same | next | rare pieces |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for kind, c in kinds.items():
            lines.append(f"| {KINDS[kind]} | {c['heads']} | {c['confident']} | {c.get('previous', '')} | {c.get('same', '')} "
                         f"| {c.get('next', '')} | {c['rare']} |")
        lines.append("")
    lines += ["### Pruning, before and after fine-tuning", "",
              "| pruned | heads | parameters | speed vs full | BLEU before [95% CI] | delta vs full | BLEU after [95% CI] | delta vs full |",
              "|---:|---:|---:|---:|---|---:|---|---:|"]

    def cell(system: dict | None) -> tuple[str, str]:
        if system is None:
            return "", ""
        low, high = system["bleu_ci"]
        row = system["delta_vs_full"]  # paired against the full model, all sentences
        delta = "" if row is None else f"{row['delta']:+.2f}" + (
            "" if row["delta_ci_low"] is None else f" [{row['delta_ci_low']:+.2f}, {row['delta_ci_high']:+.2f}]")
        return f"{system['bleu']:.1f} [{low:.1f}, {high:.1f}]", delta

    for e in study["levels"]:
        before, after = cell(e["before"]), cell(e["after"])
        lines.append(f"| {e['pruned']}% | {e['heads']}/{e['of']} | {e['parameters']:,} | {e['speed_vs_full']:.2f}x | "
                     f"{before[0]} | {before[1]} | {after[0]} | {after[1]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, required=True, help="a trained Transformer (the Multi30k recipe's)")
    parser.add_argument("--synthetic-ckpt", type=Path, help="a Transformer of the synthetic data (gold alignments)")
    parser.add_argument("--runs", type=Path, default=ROOT / "outputs" / "heads_study")
    parser.add_argument("--out", type=Path, help="study.md and study.json (default: --runs)")
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 20, 40, 60, 80], help="percent of heads pruned")
    parser.add_argument("--experiment", default="multi30k_transformer")
    parser.add_argument("--data", default="multi30k", help="the data config of the test split compared")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=5e-4)
    args = parser.parse_args()
    runs, py = args.runs.resolve(), sys.executable
    runs.mkdir(parents=True, exist_ok=True)
    analysis = ["heads=true", "head_analysis.pairs=1000", "word_frequency=false", "reordering=false"]
    tables = {"multi30k": args.ckpt, "synthetic": args.synthetic_ckpt}
    for name, ckpt in tables.items():
        if ckpt is not None:
            folder = runs / f"table_{name}"
            run([py, "evaluate.py", f"ckpts={{transformer:{ckpt.resolve()}}}", *analysis, f"hydra.run.dir={folder}"],
                folder, runs / f"table_{name}.log")
    levels = ",".join(str(p / 100) for p in args.levels)
    run([py, "-m", "nmt.prune", f"ckpt={args.ckpt.resolve()}", f"levels=[{levels}]", f"out={runs / 'prune'}",
         f"hydra.run.dir={runs / 'prune'}"], runs / "prune", runs / "prune.log")
    hyps = {}
    for pct in args.levels:
        folder = runs / f"finetune_{pct:02d}"
        run([py, "train.py", f"experiment={args.experiment}", "seed=1", f"init_from={runs / 'prune' / f'level_{pct:02d}' / 'pruned.ckpt'}",
             f"trainer.max_steps={args.steps}", f"optimizer.lr={args.lr}", f"scheduler.warmup_steps={max(1, args.steps // 10)}",
             f"trainer.val_check_interval={args.steps}", f"hydra.run.dir={folder}"], folder, runs / f"finetune_{pct:02d}.log")
        hyps[f"pruned_{pct:02d}"] = runs / "prune" / f"level_{pct:02d}" / "hyp.txt"
        hyps[f"finetuned_{pct:02d}"] = folder / "test_hyps.txt"
    listed = ",".join(f"{name}:{path}" for name, path in hyps.items())
    run([py, "evaluate.py", f"hyps={{{listed}}}", f"data={args.data}", f"baseline=pruned_{args.levels[0]:02d}",
         "word_frequency=false", "reordering=false", f"hydra.run.dir={runs / 'compare'}"], runs / "compare", runs / "compare.log")
    study = collect(runs, args.levels)
    out = (args.out or runs).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json_text(study))
    (out / "study.md").write_text(markdown(study))
    print(markdown(study), end="")


if __name__ == "__main__":
    main()

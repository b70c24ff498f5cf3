"""nmt-study: BLEU against source-sentence length (Bahdanau et al. 2015, Fig. 2) in one command.

    nmt-study                                        # synthetic data (default)
    nmt-study --experiment bleu_vs_length_europarl   # Europarl it->en
    nmt-study data=multi30k 'steps_by_model={lstm: 3000, lstm_bahdanau: 1000, lstm_luong: 1000, transformer: 1000}'

1. trains the four models, each for its budget of steps: ``nmt-train -m experiment=bleu_vs_length
   model=lstm,lstm_bahdanau,lstm_luong,transformer`` (``--experiment`` picks another
   ``nmt/conf/experiment`` file) plus any overrides given here;
2. collects each run's test report (beam search, BLEU by source-length bucket) into one
   comparison table and plot, with parameters, training tokens/s and wall time per model;
3. draws attention heatmaps of the longest test sentences for each attention model.

``--then "OVERRIDES"`` adds a second stage: each model goes on from its ``last.ckpt`` (weights,
optimizer, schedule; the same vocabulary through ``data.vocab_from``) with these overrides, e.g.
longer training pairs and larger step budgets, into ``<out>/stage2/<model>``,
collected like the first stage:

    nmt-study --experiment bleu_vs_length_europarl \
        --then "data.train_max_words=50 'steps_by_model={lstm: 7335, lstm_bahdanau: 4600, lstm_luong: 5290, transformer: 4001}'"

``--collect DIR`` redoes steps 2-3 on an existing multirun folder. ``--comet FOLDER`` (a
wmt22-comet-da folder, docs/evaluating.md) adds COMET to the table, by length and paired against
the first model. Runs go to ``<out>/<model>``,
so models trained by separate calls with the same ``--out`` (e.g. in parallel, one per core
with ``OMP_NUM_THREADS=1``) are collected together.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from nmt import CONF_DIR, register_resolvers
from nmt.runs.files import REPORT, SUMMARY, TEST_TEXT, read, read_text_lines

MODELS = ["lstm", "lstm_bahdanau", "lstm_luong", "transformer"]
log = logging.getLogger("nmt.study")


def train_all(overrides: list[str], sweep_dir: Path, models: list[str], experiment: str) -> None:
    """One ``nmt.train`` multirun over ``models``, each model's run in ``sweep_dir/<model>``."""
    command = [sys.executable, "-m", "nmt.train", "-m", f"experiment={experiment}",
               f"model={','.join(models)}", f"hydra.sweep.dir={sweep_dir}",
               "hydra.sweep.subdir=${hydra.runtime.choices.model}", *overrides]  # one folder per model
    log.info("running: %s", " ".join(command))
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"nmt-study: training failed ({experiment}, models {','.join(models)}); its log is above")


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def second_stage(overrides: list[str], then: list[str], first: Path) -> list[str]:
    """Stage-2 overrides: resume each model's stage-1 ``last.ckpt`` with its vocabulary, and
    ``then`` in place of any stage-1 override of the same key."""
    given = {override_key(o) for o in then}
    resume = [o for o in (f"ckpt_path={first}/${{hydra:runtime.choices.model}}/checkpoints/last.ckpt",
                          "data.vocab_from=${ckpt_path}") if override_key(o) not in given]
    replaced = given | {override_key(o) for o in resume}
    return [*(o for o in overrides if override_key(o) not in replaced), *resume, *then]


def model_name(summary: dict) -> str:
    for override in summary["overrides"]:
        if override.startswith("model="):
            return override.split("=", 1)[1]
    return Path(summary["decoder"]).suffix.lstrip(".")


def heatmaps(ckpt: Path, sources: list[str], out_dir: Path, count: int, unit: str = "words") -> None:
    """Attention of the ``count`` longest test sentences, by the report's length ``unit`` (models
    without attention: none)."""
    from nmt.inference.translator import Translator  # torch and matplotlib: not for --help or a refused option
    from nmt.evaluation.length_report import UNIT_NAMES, Tokens, source_lengths
    from nmt.evaluation.plots import plot_attention

    translator = Translator.load(ckpt, device="cpu", precision="32")
    counted = Tokens(lambda text: len(translator.src_vocab.encode(text))) if unit == "tokens" else unit
    lengths = source_lengths(sources, counted)
    longest = sorted(range(len(sources)), key=lambda i: -lengths[i])[:count]
    translations = translator.translate([sources[i] for i in longest], attention=True)
    for j, translation in enumerate(translations):
        a = translation.attention
        if a is not None:
            plot_attention(a.weights, a.source, a.target, out_dir / f"test{longest[j] + 1:05d}.png",
                           title=f"test line {longest[j] + 1} ({lengths[longest[j]]} {UNIT_NAMES.get(unit, unit)})")


def with_comet(runs: dict[str, Path], reports: dict[str, dict], comet: Any, seed: int = 12345) -> None:
    """Each run's COMET (``comet``: a loaded ``nmt.evaluation.comet.Comet``) by length in its
    report, and paired against the first run (``nmt.evaluation.segment_scores``), from the test
    sources, hypotheses and references the run wrote (``TEST_TEXT``)."""
    from nmt.evaluation import segment_scores
    from nmt.evaluation.length_report import bucket_bounds, bucket_indices, length_buckets

    scores, hyps, first = {}, {}, None
    for name, run in runs.items():
        if not (run / TEST_TEXT.format("refs")).is_file():
            raise SystemExit(f"nmt-study: --comet: {run / TEST_TEXT.format('refs')} is missing (a run trained before "
                             "runs kept their references); score it with evaluate.py comet.model=<folder>")
        sources, refs = (read_text_lines(run, TEST_TEXT.format(k)) for k in ("sources", "refs"))
        hyps[name] = read_text_lines(run, TEST_TEXT.format("hyps"))
        report = reports[name]
        edges = [b["high"] for b in report["buckets"] if b["high"] is not None]
        unit = report.get("unit", "words")
        if unit == "tokens":
            raise SystemExit(f"nmt-study: --comet: {run} counts its sources in SentencePiece tokens; "
                             "score it with evaluate.py comet.model=<folder>")
        if first is not None and (sources, refs) != first[1:]:
            raise SystemExit(f"nmt-study: --comet: {run} and {first[0]} were tested on different sentences; "
                             "the paired test needs one test set")
        first = first or (run, sources, refs)
        scores[name] = comet.score(sources, hyps[name], refs)
        segment_scores.add_to_report(report, scores[name], sources, edges, unit=unit,
                                     n_bootstrap=report.get("bootstrap", {}).get("resamples", 1000), about=comet.describe())
    if len(scores) > 1:
        baseline = next(iter(scores))
        edges = length_buckets([b["high"] for b in reports[baseline]["buckets"] if b["high"] is not None])
        unit = reports[baseline].get("unit", "words")
        buckets = list(zip([label for label, _, _ in bucket_bounds(edges)], bucket_indices(sources, edges, unit)))
        for name, result in segment_scores.paired(scores, hyps, baseline, buckets, seed=seed).items():
            reports[name]["comet_vs_baseline"] = result


def collect(sweep_dir: Path, num_heatmaps: int, comet: Any = None) -> Path:
    runs = sorted(p.parent for p in sweep_dir.glob(f"*/{SUMMARY}"))
    if not runs:
        raise SystemExit(f"nmt-study: no finished runs ({SUMMARY}) under {sweep_dir}")
    reports, summaries, folders = {}, {}, {}
    for run in runs:
        summary = read(run, SUMMARY)
        name = model_name(summary)
        reports[name], summaries[name], folders[name] = read(run, REPORT), summary, run
    if comet is not None:
        with_comet(folders, reports, comet)
    rows = []
    for name, report in reports.items():
        summary, run = summaries[name], folders[name]
        buckets = report["buckets"]
        rows.append(
            f"| {name} | {summary['parameters'] / 1e6:.1f}M | {summary['train_tokens_per_sec']:,.0f} | "
            f"{summary.get('train_wall_seconds', summary['fit_seconds']) / 60:.1f} | {summary['steps']} | {report['bleu']:.1f} | "
            f"{buckets[0]['bleu']:.1f} | {next(b for b in reversed(buckets) if b['count'])['bleu']:.1f} |"
            + (f" {report['comet']:.4f} |" if comet is not None else "")
        )
        if num_heatmaps and name != "lstm":
            sources = read_text_lines(run, TEST_TEXT.format("sources"))
            heatmaps(Path(summary["best_checkpoint"]), sources, sweep_dir / "attention" / name, num_heatmaps,
                     report.get("unit", "words"))
    from nmt.evaluation.comparison import compare

    paths = compare(reports, sweep_dir / "comparison", title="BLEU by source length")
    first = next(iter(reports.values()))
    longest = next(b for b in reversed(first["buckets"]) if b["count"])["label"]
    table = "\n".join([
        f"| model | parameters | train tokens/s | train minutes | steps | test BLEU | BLEU {first['buckets'][0]['label']} | BLEU {longest} |"
        + (" test COMET |" if comet is not None else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if comet is not None else ""),
        *rows,
    ])
    summary_md = sweep_dir / "summary.md"
    summary_md.write_text(table + "\n\n" + paths["md"].read_text())
    log.info("study summary -> %s\n%s", summary_md, summary_md.read_text())
    return summary_md


def check_arguments(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The model presets of ``--models``; SystemExit with one line naming what is wrong."""
    if args.collect is not None and args.then is not None:
        raise SystemExit("nmt-study: --then trains a second stage; --collect only collects: give one of them")
    if args.collect is not None and not args.collect.is_dir():
        raise SystemExit(f"nmt-study: --collect {args.collect}: no such folder")
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        raise SystemExit(f"nmt-study: unknown option {unknown[0]} (overrides are key=value; --help lists the options)")
    models = args.models.split(",")
    for name, group in [*((m, "model") for m in models), (args.experiment, "experiment")]:
        if not (Path(CONF_DIR) / group / f"{name}.yaml").is_file():
            raise SystemExit(f"nmt-study: no {group} preset '{name}' (nmt/conf/{group}/{name}.yaml)")
    if args.heatmaps < 0:
        raise SystemExit(f"nmt-study: --heatmaps {args.heatmaps}: give 0 or more")
    return models


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="nmt-study", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collect", type=Path, help="only collect an existing multirun folder")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated model presets")
    parser.add_argument("--experiment", default="bleu_vs_length", help="nmt/conf/experiment file of the study")
    parser.add_argument("--heatmaps", type=int, default=3, help="long test sentences to plot per attention model")
    parser.add_argument("--out", type=Path, default=None, help="multirun folder (default outputs/<experiment>/<time>)")
    parser.add_argument("--then", default=None, metavar="OVERRIDES",
                        help="a second stage: go on from each model's last.ckpt with these overrides")
    parser.add_argument("--comet", default=None, metavar="FOLDER",
                        help="score the test translations with COMET too: a wmt22-comet-da folder (docs/evaluating.md)")
    parser.add_argument("--comet-batch-size", type=int, default=16, help="sentences COMET encodes at once")
    args, overrides = parser.parse_known_args()
    models = check_arguments(args, overrides)
    register_resolvers()  # checkpoint configs may use them
    comet = None
    if args.comet is not None:  # before any training: a wrong folder is one line now, not after hours
        from nmt.machine import decoding_device
        from nmt.evaluation.comet_files import CometRefused, load_comet

        try:
            comet = load_comet(args.comet, batch_size=args.comet_batch_size, device=decoding_device("auto", "32"))
        except CometRefused as e:
            raise SystemExit(f"nmt-study: --comet: {e}") from None
    if args.collect is not None:
        collect(args.collect, args.heatmaps, comet)
        return
    sweep_dir = (args.out or Path("outputs") / args.experiment / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    train_all(overrides, sweep_dir, models, args.experiment)
    collect(sweep_dir, args.heatmaps, comet)
    if args.then is not None:
        train_all(second_stage(overrides, shlex.split(args.then), sweep_dir), sweep_dir / "stage2", models, args.experiment)
        if comet is not None:
            comet.forget()
        collect(sweep_dir / "stage2", args.heatmaps, comet)


if __name__ == "__main__":
    main()

"""Several systems' reports side by side: one table (markdown, CSV, JSON) and one plot with a curve
per system, with the paired tests and the other analyses the reports hold."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from nmt.evaluation import reordering, segment_scores, word_frequency
from nmt.evaluation.length_report import markdown_table, plot_bleu_by_length
from nmt.evaluation.significance import significance_table
from nmt.runs.files import json_text

SIGNIFICANCE_COLUMNS = ["vs_baseline", "differing", "delta_bleu", "delta_ci_low", "delta_ci_high", "p_bootstrap",
                        "p_randomization"]
COMET_COLUMNS = ["comet", "comet_ci_low", "comet_ci_high", "delta_comet", "delta_comet_ci_low", "delta_comet_ci_high",
                 "p_bootstrap_comet"]


def compare(reports: dict[str, dict[str, Any]], out_dir: Path, title: str = "") -> dict[str, Path]:
    """Write the comparison of several systems: JSON, CSV (a row per system and bucket), markdown, PNG.

    A report with a ``significance`` entry (``nmt.evaluation.significance.significance``) fills the CSV's
    columns ``SIGNIFICANCE_COLUMNS`` (blank for the baseline) and adds its table to the markdown.
    Reports scored with COMET (``nmt.evaluation.segment_scores``) add ``COMET_COLUMNS``, the paired
    test's from their ``comet_vs_baseline`` entry, and its table.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"comparison.{ext}" for ext in ("json", "csv", "md", "png")}
    paths["json"].write_text(json_text(reports))
    comet = any(r.get("comet") is not None for r in reports.values())
    with paths["csv"].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["system", "bucket", "count", "bleu", "chrf", "bleu_ci_low", "bleu_ci_high", "length_ratio",
                         *SIGNIFICANCE_COLUMNS, *(COMET_COLUMNS if comet else [])])
        for name, report in reports.items():
            rows = len(report["buckets"]) + 1
            sig = report.get("significance")
            tests = [[sig["baseline"], *(r[k] for k in ("differing", "delta", "delta_ci_low", "delta_ci_high",
                                                           "p_bootstrap", "p_randomization"))]
                     for r in sig["rows"]] if sig else [[None] * len(SIGNIFICANCE_COLUMNS)] * rows
            if comet:
                test = report.get("comet_vs_baseline")
                paired = ([[r[k] for k in ("delta", "delta_ci_low", "delta_ci_high", "p_bootstrap")] for r in test["rows"]]
                          if test else [[None] * 4] * rows)
                cells = [[b.get("comet"), b.get("comet_ci_low"), b.get("comet_ci_high")] for b in report["buckets"]]
                cells.append([report.get("comet"), *(report.get("comet_ci") or [None, None])])
                tests = [[*t, *c, *p] for t, c, p in zip(tests, cells, paired)]
            for b, test in zip(report["buckets"], tests):
                writer.writerow([name, b["label"], b["count"], b["bleu"], b["chrf"], b["bleu_ci_low"], b["bleu_ci_high"],
                                 b.get("length_ratio"), *test])
            writer.writerow([name, "all", report["count"], report["bleu"], report["chrf"], *report["bleu_ci"],
                             report.get("length_ratio"), *tests[-1]])
    table, frequency = significance_table(reports), word_frequency.markdown(reports)
    comet_table = segment_scores.markdown(reports)
    table += ("\n" if table and comet_table else "") + comet_table
    source = next((r["reordering_alignments"] for r in reports.values() if r.get("reordering_alignments")), "")
    beyond = reordering.markdown(reports, source)
    tested = significance_table(reports, "reordering_vs_baseline")
    beyond += ("\nBy reordering distance: " + tested) if tested else ""
    timed = timing_table(reports)
    paths["md"].write_text(markdown_table(reports) + ("\n" + table if table else "") + ("\n" + timed if timed else "")
                           + ("\nWord F-measure by the word's count on the training target side:\n\n" + frequency
                              if frequency else "") + ("\n" + beyond if beyond else ""))
    plot_bleu_by_length(reports, paths["png"], title=title)
    return paths


def timing_table(reports: dict[str, dict[str, Any]]) -> str:
    """A markdown table of each system's translation time (``translation_seconds``: the whole split,
    the analyses' attention included when they asked for it), or "" when no report has one."""
    rows = [(name, r["count"], r["translation_seconds"]) for name, r in reports.items() if "translation_seconds" in r]
    if not rows:
        return ""
    lines = ["| system | sentences | translation s | sentences/s |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {count} | {seconds:.1f} | {count / seconds if seconds else 0:.1f} |" for name, count, seconds in rows]
    return "Translation time:\n\n" + "\n".join(lines) + "\n"

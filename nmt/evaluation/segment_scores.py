"""A metric that is the mean of segment scores (COMET, ``nmt.evaluation.comet``) by source length,
with bootstrap intervals, and paired against a baseline.

The buckets are the length report's (``nmt.evaluation.length_report.bucket_indices``), so COMET
and BLEU are read on the same sentences. A bucket's interval is the 95% percentile interval of the
mean over ``n`` resamples of its sentences, drawn as ``bootstrap_bleu`` draws them. The paired test
is sacreBLEU's paired bootstrap (Koehn 2004) on the segment scores: both systems' means on the same
resampled indices (``default_rng(seed).choice(N, (n, N))``), the delta's 95% interval from those
resamples, and p = (1 + #{|d_i| - mean|d| > |delta|}) / (n + 1), sacreBLEU's count. As for BLEU
(``nmt.evaluation.significance``), a bucket whose hypotheses are the baseline's gets delta 0 and
p = 1, and one where fewer than ``min_sentences`` differ its delta alone.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from nmt.evaluation.length_report import Unit, bucket_indices


def mean_interval(scores: np.ndarray, n: int, seed: int) -> tuple[float, float]:
    """95% percentile interval of the mean of ``scores`` (N,) over ``n`` resamples."""
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(len(scores), np.full(len(scores), 1.0 / len(scores)), size=n)  # (n, N)
    means = weights @ scores / len(scores)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def add_to_report(report: dict[str, Any], scores: np.ndarray, sources: Sequence[str], edges: Sequence[int],
                  unit: Unit = "words", n_bootstrap: int = 1000, seed: int = 12345, metric: str = "comet",
                  about: dict[str, Any] | None = None) -> dict[str, Any]:
    """Put the mean of ``scores`` (one per sentence) and its 95% interval into a length report
    (``length_report``'s dict): ``<metric>``, ``<metric>_ci`` overall and ``<metric>``,
    ``<metric>_ci_low``, ``<metric>_ci_high`` in each bucket (None where empty); ``about``
    (model, batch size, ...) as ``<metric>_settings``."""
    scores = np.asarray(scores, dtype=np.float64)
    if len(scores) != report["count"]:
        raise ValueError(f"{len(scores)} {metric} scores for a report of {report['count']} sentences")

    def score(index: np.ndarray) -> tuple[float | None, float | None, float | None]:
        if len(index) == 0:
            return None, None, None
        low, high = mean_interval(scores[index], n_bootstrap, seed) if n_bootstrap > 1 else (math.nan, math.nan)
        return float(scores[index].mean()), low, high

    for bucket, index in zip(report["buckets"], bucket_indices(sources, edges, unit)):
        if len(index) != bucket["count"]:
            raise ValueError(f"bucket {bucket['label']}: {len(index)} sources, the report has {bucket['count']}")
        bucket[metric], bucket[f"{metric}_ci_low"], bucket[f"{metric}_ci_high"] = score(index)
    overall = score(np.arange(len(scores)))
    report[metric], report[f"{metric}_ci"] = overall[0], [overall[1], overall[2]]
    report[f"{metric}_settings"] = {**(about or {}), "bootstrap": {"resamples": n_bootstrap, "seed": seed}}
    return report


def paired_bootstrap(scores: np.ndarray, base: np.ndarray, n: int, seed: int | None) -> tuple[float, float, float]:
    """delta's 95% interval and p-value of mean(``scores``) - mean(``base``) (N,) over ``n`` paired resamples."""
    size = len(scores)
    idx = np.random.default_rng(seed).choice(size, size=(n, size), replace=True)  # (n, N), as PairedTest 'bs'
    diffs = (scores - base)[idx].mean(1)  # (n,)
    centred = np.abs(diffs) - np.abs(diffs).mean()
    p = (np.sum(centred > abs(float((scores - base).mean()))) + 1) / (n + 1)
    return float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5)), float(p)


def paired(scores: dict[str, np.ndarray], hyps: dict[str, Sequence[str]], baseline: str,
           buckets: Sequence[tuple[str, np.ndarray]], bootstrap: int = 1000, seed: int | None = 12345,
           min_sentences: int = 10, metric: str = "comet", **_: Any) -> dict[str, dict[str, Any]]:
    """``{system: {"baseline", "metric", "rows": [one per bucket, then "all"], ...}}`` for every
    system but ``baseline``. A row: bucket, count, differing, delta, delta_ci_low/high, p_bootstrap
    (None where not computed). ``buckets``: (label, sentence indices) pairs; the keys of
    ``significance`` (``randomization``) that do not apply here are accepted and ignored."""
    if baseline not in scores:
        raise ValueError(f"baseline {baseline!r} is not one of the systems {list(scores)}")
    size = len(scores[baseline])
    labels, indices = [label for label, _ in buckets] + ["all"], [index for _, index in buckets] + [np.arange(size)]
    out = {}
    for name in (n for n in scores if n != baseline):
        rows = []
        for label, index in zip(labels, indices):
            differing = sum(hyps[name][i] != hyps[baseline][i] for i in index)
            row = {"bucket": label, "count": len(index), "differing": differing, "delta": None, "delta_ci_low": None,
                   "delta_ci_high": None, "p_bootstrap": None}
            if len(index) and differing == 0:
                row.update(delta=0.0, delta_ci_low=0.0, delta_ci_high=0.0, p_bootstrap=1.0 if bootstrap else None)
            elif len(index):
                a, b = scores[name][index], scores[baseline][index]
                row["delta"] = float(a.mean() - b.mean())
                if differing >= min_sentences and bootstrap:
                    row["delta_ci_low"], row["delta_ci_high"], row["p_bootstrap"] = paired_bootstrap(a, b, bootstrap, seed)
            rows.append(row)
        out[name] = {"baseline": baseline, "metric": metric, "bootstrap": bootstrap, "seed": seed,
                     "min_sentences": min_sentences, "rows": rows}
    return out


def cell(value: float | None, low: float | None = None, high: float | None = None, signed: bool = False) -> str:
    """``0.8412 [0.8301, 0.8519]``; without an interval (None or NaN) the score alone."""
    spec = "+.4f" if signed else ".4f"
    if value is None:
        return "empty"
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return format(value, spec)
    return f"{value:{spec}} [{low:{spec}}, {high:{spec}}]"


def markdown(reports: dict[str, dict[str, Any]], key: str = "comet_vs_baseline") -> str:
    """The paired tests' table of each report's ``key`` entry; empty without one."""
    tested = {name: r[key] for name, r in reports.items() if r.get(key)}
    if not tested:
        return ""
    first = next(iter(tested.values()))
    metric = first["metric"].upper()
    lines = [f"{metric}: paired bootstrap against `{first['baseline']}` on segment scores ({first['bootstrap']} "
             f"resamples, seed {first['seed']}):", "",
             f"| system vs baseline | bucket | sentences | differing | delta {metric} [95% CI] | p bootstrap |",
             "|---|---|---:|---:|---:|---:|"]
    for name, test in tested.items():
        for row in test["rows"]:
            delta = "empty" if row["count"] == 0 else cell(row["delta"], row["delta_ci_low"], row["delta_ci_high"], signed=True)
            p = "n/a" if row["p_bootstrap"] is None else f"{row['p_bootstrap']:.4f}"
            lines.append(f"| {name} vs {test['baseline']} | {row['bucket']} | {row['count']} | {row['differing']} | {delta} | {p} |")
    return "\n".join(lines) + "\n"

"""Paired significance tests of systems against a baseline, overall and by source length.

Both tests are sacreBLEU's public ``PairedTest``: paired bootstrap resampling (``bs``, Koehn 2004)
and paired approximate randomisation (``ar``, Riezler and Maxwell 2005), run once on the whole test
set and once on each length bucket's sentences. The BLEU difference's 95% interval is the
percentile interval of ``BLEU(system) - BLEU(baseline)`` over resampled corpora, both systems
scored on the same resampled sentence indices; they are drawn as sacreBLEU's paired bootstrap draws
its own (``default_rng(seed).choice(N, (n, N))``), so interval and p-value come from the same
resamples.

sacreBLEU counts a resample as "as extreme" only when its difference is strictly larger than the
observed one, so a system identical to the baseline gets the smallest p-value, 1 / (n + 1), and so
do buckets of one or two sentences. Here a bucket where the hypotheses are identical gets delta 0
and p = 1 without running the tests, and one where fewer than ``min_sentences`` hypotheses differ
gets its delta but no interval and no p-values (None): swapping k differing sentences has 2^k
outcomes, so an exact randomisation p-value cannot go below 2 / 2^k, while sacreBLEU's strict count
reports 1 / (n + 1) whenever the observed difference is the largest (k = 10: 0.002).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

import numpy as np
from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

from nmt.evaluation.length_report import bleu_from_stats, bucket_bounds, bucket_indices, length_buckets, sentence_stats


@contextlib.contextmanager
def sacrebleu_seed(seed: int | None) -> Iterator[None]:
    """``SACREBLEU_SEED`` set to ``seed`` (None: unseeded) inside the block, restored after.

    ``PairedTest`` reads it when it is built (and seeds the baseline's bootstrap then); it has no
    seed argument.
    """
    if seed == 0:  # PairedTest.__call__ passes `seed if seed else None`: 0 would be unseeded
        raise ValueError("significance.seed: sacreBLEU reads 0 as unseeded; use another seed (or null)")
    before = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = "none" if seed is None else str(int(seed))
    try:
        yield
    finally:
        if before is None:
            del os.environ["SACREBLEU_SEED"]
        else:
            os.environ["SACREBLEU_SEED"] = before


def paired_p_values(named: list[tuple[str, list[str]]], refs: list[str], tokenize: str | None, test_type: str,
                    n: int, seed: int | None) -> tuple[dict[str, float], str]:
    """p-value of every system after the first (the baseline) from ``PairedTest``, and its signature."""
    bleu = BLEU(tokenize=tokenize) if tokenize else BLEU()
    with sacrebleu_seed(seed):
        # n_jobs=1: other values fork a worker pool per call (per bucket), unsafe after torch starts threads
        test = PairedTest(named, {"BLEU": bleu}, [refs], test_type=test_type, n_samples=n, n_jobs=1)
    signatures, scores = test()
    (metric,) = [k for k in scores if k != "System"]
    p = {name: float(result.p_value) for name, result in zip(scores["System"][1:], scores[metric][1:])}
    return p, str(signatures[metric])


def delta_interval(bleu: BLEU, stats: np.ndarray, base_stats: np.ndarray, n: int, seed: int | None) -> tuple[float, float]:
    """95% percentile interval of BLEU(system) - BLEU(baseline) over ``n`` paired resamples, ``stats`` (N, K)."""
    size = len(stats)
    idx = np.random.default_rng(seed).choice(size, size=(n, size), replace=True)  # (n, N), as PairedTest 'bs'
    weights = np.bincount((idx + size * np.arange(n)[:, None]).ravel(), minlength=n * size).reshape(n, size)
    diffs = np.array([bleu_from_stats(bleu, s) - bleu_from_stats(bleu, b)
                      for s, b in zip(weights @ stats, weights @ base_stats)])
    return float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))


def significance(
    hyps: dict[str, Sequence[str]],
    sources: Sequence[str],
    refs: Sequence[str],
    baseline: str,
    edges: Sequence[int],
    unit: str = "words",
    tokenize: str | None = None,
    bootstrap: int = 1000,
    randomization: int = 10000,
    seed: int | None = 12345,
    min_sentences: int = 10,
    buckets: Sequence[tuple[str, np.ndarray]] | None = None,
) -> dict[str, dict[str, Any]]:
    """``{system: {"baseline", "rows": [one per bucket, then "all"], ...}}`` for every non-baseline system.

    A row: bucket, count, differing (sentences whose hypotheses differ from the baseline's), delta
    (BLEU points), delta_ci_low/high, p_bootstrap, p_randomization; None where not computed.
    ``bootstrap``/``randomization`` = 0 turns that test (and, for bootstrap, the interval) off.
    ``buckets``: (label, sentence indices) pairs to test instead of the length buckets of ``edges``
    (the reordering buckets, ``nmt.evaluation.reordering``)."""
    if baseline not in hyps:
        raise ValueError(f"baseline {baseline!r} is not one of the systems {list(hyps)}")
    bleu = BLEU(tokenize=tokenize) if tokenize else BLEU()
    stats = {name: sentence_stats(bleu, h, refs) for name, h in hyps.items()}
    others = [name for name in hyps if name != baseline]
    if buckets is None:
        edges = length_buckets(edges, unit)
        buckets = list(zip([label for label, _, _ in bucket_bounds(edges)], bucket_indices(sources, edges, unit)))
    labels = [label for label, _ in buckets] + ["all"]
    indices = [index for _, index in buckets] + [np.arange(len(refs))]
    out: dict[str, dict[str, Any]] = {
        name: {"baseline": baseline, "bootstrap": bootstrap, "randomization": randomization, "seed": seed,
               "min_sentences": min_sentences, "signatures": {}, "rows": []}
        for name in others
    }
    for label, index in zip(labels, indices):
        rows = {}
        for name in others:
            differing = sum(hyps[name][i] != hyps[baseline][i] for i in index)
            row = {"bucket": label, "count": len(index), "differing": differing, "delta": None, "delta_ci_low": None,
                   "delta_ci_high": None, "p_bootstrap": None, "p_randomization": None}
            if len(index):
                row["delta"] = bleu_from_stats(bleu, stats[name][index].sum(0)) - bleu_from_stats(bleu, stats[baseline][index].sum(0))
            if len(index) and differing == 0:  # the same hypotheses: no difference to test
                row.update(delta=0.0, delta_ci_low=0.0, delta_ci_high=0.0, p_bootstrap=1.0 if bootstrap else None,
                           p_randomization=1.0 if randomization else None)
            elif len(index) and differing >= min_sentences and bootstrap:
                row["delta_ci_low"], row["delta_ci_high"] = delta_interval(bleu, stats[name][index], stats[baseline][index],
                                                                           bootstrap, seed)
            rows[name] = row
        tested = [name for name in others if rows[name]["differing"] >= max(min_sentences, 1)]
        if tested:
            named = [(n, [hyps[n][i] for i in index]) for n in [baseline, *tested]]
            bucket_refs = [refs[i] for i in index]
            for key, test_type, n in (("p_bootstrap", "bs", bootstrap), ("p_randomization", "ar", randomization)):
                if n:
                    p, signature = paired_p_values(named, bucket_refs, tokenize, test_type, n, seed)
                    for name in tested:
                        rows[name][key] = p[name]
                        if label == "all":
                            out[name]["signatures"][test_type] = signature
        for name in others:
            out[name]["rows"].append(rows[name])
    return out


def _cell(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def significance_table(reports: dict[str, dict[str, Any]], key: str = "significance") -> str:
    """Markdown: system vs baseline, bucket, delta BLEU [95% CI], p bootstrap, p randomisation, of
    each report's ``key`` entry (``significance``: the length buckets)."""
    tested = {name: r[key] for name, r in reports.items() if r.get(key)}
    if not tested:
        return ""
    first = next(iter(tested.values()))
    lines = [
        f"Paired tests against `{first['baseline']}` (sacreBLEU `PairedTest`: {first['bootstrap']} bootstrap "
        f"resamples, {first['randomization']} randomisation trials, seed {first['seed']}):",
        "",
        "| system vs baseline | bucket | sentences | differing | delta BLEU [95% CI] | p bootstrap | p randomisation |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, sig in tested.items():
        for row in sig["rows"]:
            if row["count"] == 0:
                delta = "empty"
            elif row["delta_ci_low"] is None:
                delta = f"{row['delta']:+.2f}"
            else:
                delta = f"{row['delta']:+.2f} [{row['delta_ci_low']:+.2f}, {row['delta_ci_high']:+.2f}]"
            lines.append(f"| {name} vs {sig['baseline']} | {row['bucket']} | {row['count']} | {row['differing']} | {delta} | "
                         f"{_cell(row['p_bootstrap'], '.4f')} | {_cell(row['p_randomization'], '.4f')} |")
    lines += ["", f"n/a: fewer than {first['min_sentences']} sentences whose hypotheses differ from the baseline's "
              "(identical hypotheses: delta 0, p = 1)."]
    for test_type, signature in first["signatures"].items():
        lines.append(f"sacreBLEU {test_type}: `{signature}`")
    return "\n".join(lines) + "\n"

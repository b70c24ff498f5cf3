"""BLEU by reordering distance, and attention entropy by length: two more views beside length.

Reordering distance of a sentence pair: how far, in words, its aligned words move on average,
``mean |s - t * (source words - 1) / (target words - 1)|`` over the word-alignment links (s, t):
the target position scaled onto the source's, so that a longer or shorter translation alone adds
little (a monotone translation of the same length scores 0). It is the distortion a phrase-based system pays
for, per word. A side in a language written without spaces (Chinese, Japanese, Thai: ``nmt.languages.writing``)
counts characters instead of whitespace "words", which there are whole clauses. The synthetic pair's noun-adjective swaps move words by one, its verb-final
clauses by the length of the object and adverb. The alignments are gold ones where the data
have them (the synthetic generator's), else a model's forced alignment of the references. Every
system is scored on the same sentences in each bucket, with a 95% bootstrap interval of its BLEU,
as the length buckets.

Attention entropy: per output word, the entropy (nats) of its attention over the source pieces,
averaged over the sentence's words; low is sharp, log(source pieces) is uniform. Reported per
source-length bucket: attention that spreads out on long sentences is a sign of the forgetting
the length curve shows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from sacrebleu.metrics import BLEU

from nmt.evaluation.length_report import Unit, bootstrap_bleu, bucket_indices, bucket_bounds, length_buckets, sentence_stats

EDGES = (0.25, 0.5, 0.75, 1.0, 1.5)  # bucket upper edges, in words; 0 gets a bucket of its own


def reordering_distance(links: set[tuple[int, int]], src_words: int, tgt_words: int) -> float:
    """Mean distance (words) aligned words move: |s - t * (src_words - 1) / (tgt_words - 1)| over
    the links (the first and last target words scaled onto the first and last source words)."""
    if not links or not tgt_words:
        return 0.0
    scale = (src_words - 1) / (tgt_words - 1) if tgt_words > 1 else 0.0
    return sum(abs(s - t * scale) for s, t in links) / len(links)


def reordering_labels(edges: Sequence[float] = EDGES) -> list[str]:
    """``["0", "0-0.25", "0.25-0.5", "0.5-0.75", "0.75-1", "1-1.5", ">1.5"]`` for the default edges."""
    bounds = [0.0, *edges]
    return ["0", *(f"{a:g}-{b:g}" for a, b in zip(bounds, edges)), f">{edges[-1]:g}"]


def reordering_buckets(distances: Sequence[float], edges: Sequence[float] = EDGES) -> list[np.ndarray]:
    """Sentence indices per bucket: exactly 0, then (0, e1], (e1, e2], ..., above the last edge."""
    d = np.asarray(distances, dtype=float)
    bounds = [0.0, *edges, math.inf]
    out = [np.flatnonzero(d == 0)]
    out += [np.flatnonzero((d > low) & (d <= high)) for low, high in zip(bounds[:-1], bounds[1:])]
    return out


def bleu_by_reordering(hyps: Sequence[str], refs: Sequence[str], distances: Sequence[float],
                       edges: Sequence[float] = EDGES, tokenize: str | None = None, n_bootstrap: int = 1000,
                       seed: int = 12345) -> list[dict[str, Any]]:
    """Per reordering bucket: sentences, mean distance, corpus BLEU and its 95% bootstrap interval."""
    if not len(hyps) == len(refs) == len(distances):
        raise ValueError(f"{len(hyps)} hypotheses, {len(refs)} references and {len(distances)} distances differ in number")
    bleu = BLEU(tokenize=tokenize) if tokenize else BLEU()
    stats = sentence_stats(bleu, hyps, refs)
    out = []
    for label, index in zip(reordering_labels(edges), reordering_buckets(distances, edges)):
        row: dict[str, Any] = {"bucket": label, "count": int(len(index)), "bleu": None, "bleu_ci_low": None,
                               "bleu_ci_high": None, "mean_distance": None}
        if len(index):
            low, high = bootstrap_bleu(bleu, stats[index], n_bootstrap, seed) if n_bootstrap > 1 else (math.nan, math.nan)
            row |= {"bleu": bleu.corpus_score([hyps[i] for i in index], [[refs[i] for i in index]]).score,
                    "bleu_ci_low": low, "bleu_ci_high": high,
                    "mean_distance": float(np.mean([distances[i] for i in index]))}
        out.append(row)
    return out


def sentence_entropy(weights: Sequence[Sequence[float]]) -> float:
    """Mean entropy (nats) of the rows of a (target pieces x source pieces) attention matrix."""
    w = np.clip(np.asarray(weights, dtype=float), 1e-12, None)
    w = w / w.sum(1, keepdims=True)
    return float(np.mean(-(w * np.log(w)).sum(1))) if len(w) else 0.0


def entropy_by_length(sources: Sequence[str], entropies: Sequence[float | None], edges: Sequence[int] | str,
                      unit: Unit = "words") -> list[dict[str, Any]]:
    """Per source-length bucket: sentences with attention and their mean attention entropy."""
    out, edges = [], length_buckets(edges, unit)
    for (label, _, _), index in zip(bucket_bounds(edges), bucket_indices(sources, edges, unit)):
        values = [entropies[i] for i in index if entropies[i] is not None]
        out.append({"bucket": label, "count": len(values), "entropy": float(np.mean(values)) if values else None})
    return out


def markdown(reports: dict[str, dict[str, Any]], source: str) -> str:
    """The reordering table (one BLEU column per system) and the attention-entropy table."""
    lines = []
    names = [n for n, r in reports.items() if r.get("reordering")]
    if names:
        first = reports[names[0]]["reordering"]
        unit = {"words": "words", "chars": "characters"}[reports[names[0]].get("reordering_units", ["words"])[0]]
        lines += [f"BLEU by reordering distance (mean {unit} an aligned word moves, {source} alignments):", "",
                  f"| reordering ({unit}) | sentences | mean | " + " | ".join(f"{n} BLEU [95% CI]" for n in names) + " |",
                  "|---|---:|---:|" + "---:|" * len(names)]
        for k, bucket in enumerate(first):
            cells = ["empty" if reports[n]["reordering"][k]["count"] == 0 else
                     f"{reports[n]['reordering'][k]['bleu']:.1f} [{reports[n]['reordering'][k]['bleu_ci_low']:.1f}, "
                     f"{reports[n]['reordering'][k]['bleu_ci_high']:.1f}]" for n in names]
            mean = "" if bucket["mean_distance"] is None else f"{bucket['mean_distance']:.3f}"
            lines.append(f"| {bucket['bucket']} | {bucket['count']} | {mean} | " + " | ".join(cells) + " |")
        lines.append("")
    names = [n for n, r in reports.items() if r.get("attention_entropy")]
    if names:
        first = reports[names[0]]["attention_entropy"]
        lines += ["Attention entropy (nats per output piece) by source length:", "",
                  "| source length | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for k, bucket in enumerate(first):
            cells = ["" if reports[n]["attention_entropy"][k]["entropy"] is None else
                     f"{reports[n]['attention_entropy'][k]['entropy']:.2f}" for n in names]
            lines.append(f"| {bucket['bucket']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)

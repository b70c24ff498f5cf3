"""Word accuracy by training frequency: where, beyond length, a system fails.

compare-mt's word-accuracy analysis (Neubig et al. 2019): every reference and output word falls
in a band by how often it occurs on the target side of the training corpus (unseen, 1, 2, 3, 4,
5-9, 10-99, 100-999, 1000 and more), and each band gets the precision, recall and F-measure of
the output's words against the reference's. A match is a word both sentences hold, counted at
most as often as the fewer of the two have it (BLEU's clipped unigram matches). Words are the
tokens BLEU scores the target language in (sacreBLEU's tokenizer that ``nmt.languages.writing`` picks: 13a
for a language written with spaces, so punctuation counts as words; ``zh`` for Chinese, whose
characters are its words; ``char``, ``ja-mecab``, ...), never whitespace-split clauses. A band
without a word in either the references or the outputs is empty (None), not F 0. Rare words are where NMT
systems fail first (Koehn and Knowles 2017). The F-measure of each band has a 95% bootstrap
interval over sentences, and ``paired`` tests a system against a baseline band by band.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from sacrebleu.metrics import BLEU

CUTOFFS = (1, 2, 3, 4, 5, 10, 100, 1000)  # compare-mt's default band edges


@functools.cache
def tokenizer(tokenize: str | None = None) -> Callable[[str], str]:
    """sacreBLEU's tokenizer of that name (None: its default, 13a)."""
    return BLEU(tokenize=tokenize).tokenizer


def words(text: str, tokenize: str | None = None) -> list[str]:
    """The words of ``text`` as BLEU counts them with sacreBLEU's ``tokenize``."""
    return tokenizer(tokenize)(text).split()


def counts(lines: Iterable[str], tokenize: str | None = None) -> Counter[str]:
    """Training-corpus word counts (of the target side, for ``bands``, in the same ``tokenize``)."""
    total: Counter[str] = Counter()
    for line in lines:
        total.update(words(line, tokenize))
    return total


def labels(cutoffs: Sequence[int] = CUTOFFS) -> list[str]:
    """``["unseen", "1", "2", "3", "4", "5-9", "10-99", "100-999", ">=1000"]`` for the default edges."""
    out = ["unseen" if cutoffs[0] == 1 else f"<{cutoffs[0]}"]
    for low, high in zip(cutoffs, cutoffs[1:]):
        out.append(str(low) if high == low + 1 else f"{low}-{high - 1}")
    return out + [f">={cutoffs[-1]}"]


def _band(frequency: int, cutoffs: Sequence[int]) -> int:
    return int(np.searchsorted(cutoffs, frequency, side="right"))


def sentence_counts(hyps: Sequence[str], refs: Sequence[str], frequency: Mapping[str, int],
                    cutoffs: Sequence[int] = CUTOFFS, tokenize: str | None = None) -> np.ndarray:
    """(sentences, bands, 3) int64: per sentence and band, the reference's words, the output's
    words, and the matches (words: sacreBLEU's ``tokenize``)."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses for {len(refs)} references")
    out = np.zeros((len(hyps), len(cutoffs) + 1, 3), dtype=np.int64)
    for i, (hyp, ref) in enumerate(zip(hyps, refs)):
        h, r = Counter(words(hyp, tokenize)), Counter(words(ref, tokenize))
        for word, n in r.items():
            out[i, _band(frequency.get(word, 0), cutoffs), 0] += n
        for word, n in h.items():
            band = _band(frequency.get(word, 0), cutoffs)
            out[i, band, 1] += n
            out[i, band, 2] += min(n, r.get(word, 0))
    return out


def _fmeasure(totals: np.ndarray) -> np.ndarray:
    """(..., bands, 3) summed counts -> (..., bands) F-measure in percent (NaN where a band is empty)."""
    ref, hyp, match = totals[..., 0], totals[..., 1], totals[..., 2]
    with np.errstate(invalid="ignore", divide="ignore"):
        f = np.where(ref + hyp > 0, 200.0 * match / (ref + hyp), np.nan)  # 2PR / (P + R) = 2m / (ref + hyp)
    return f


def _interval(samples: np.ndarray) -> tuple[float | None, float | None]:
    """The 95% percentile interval of the resamples in which the band holds words (None: none does)."""
    kept = samples[~np.isnan(samples)]
    return (float(np.percentile(kept, 2.5)), float(np.percentile(kept, 97.5))) if len(kept) else (None, None)


def _number(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def _resampled(per: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(resamples, bands, 3) summed counts of the resampled corpora: ``weights`` (resamples, N)
    says how often each sentence is drawn (memory: resamples x N, not x bands too)."""
    return (weights @ per.reshape(len(per), -1)).reshape(len(weights), *per.shape[1:])


def _weights(n: int, n_bootstrap: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=n_bootstrap)


def bands(hyps: Sequence[str], refs: Sequence[str], frequency: Mapping[str, int], cutoffs: Sequence[int] = CUTOFFS,
          n_bootstrap: int = 1000, seed: int = 12345, tokenize: str | None = None) -> list[dict[str, Any]]:
    """Per frequency band: words (sacreBLEU's ``tokenize``) in the references and outputs, matches,
    precision, recall and F-measure (percent) with a 95% bootstrap interval over sentences; None
    where there is nothing to divide by (F and its interval of a band with no words at all)."""
    per = sentence_counts(hyps, refs, frequency, cutoffs, tokenize)
    totals = per.sum(0)
    f = _fmeasure(totals)
    samples = _fmeasure(_resampled(per, _weights(len(per), n_bootstrap, seed))) if n_bootstrap and len(per) else None
    out = []
    for b, label in enumerate(labels(cutoffs)):
        ref, hyp, match = (int(v) for v in totals[b])
        low, high = _interval(samples[:, b]) if samples is not None and ref + hyp else (_number(f[b]), _number(f[b]))
        out.append({"band": label, "ref_words": ref, "hyp_words": hyp, "matches": match,
                    "precision": 100.0 * match / hyp if hyp else None, "recall": 100.0 * match / ref if ref else None,
                    "f": _number(f[b]), "f_ci_low": low, "f_ci_high": high})
    return out


def paired(hyps: Sequence[str], baseline: Sequence[str], refs: Sequence[str], frequency: Mapping[str, int],
           cutoffs: Sequence[int] = CUTOFFS, n_bootstrap: int = 1000, seed: int = 12345,
           tokenize: str | None = None) -> list[dict[str, Any]]:
    """Per band, the F-measure of ``hyps`` minus the baseline's, its 95% paired-bootstrap interval
    and p-value (the share of resamples in which the difference is not above zero, two-sided); a
    band where either system's F is empty (no words there) has no difference (None), no test."""
    a = sentence_counts(hyps, refs, frequency, cutoffs, tokenize)
    b = sentence_counts(baseline, refs, frequency, cutoffs, tokenize)
    delta = _fmeasure(a.sum(0)) - _fmeasure(b.sum(0))
    weights = _weights(len(a), n_bootstrap, seed) if len(a) and n_bootstrap else None
    samples = _fmeasure(_resampled(a, weights)) - _fmeasure(_resampled(b, weights)) if weights is not None else None
    out = []
    for k, label in enumerate(labels(cutoffs)):
        row: dict[str, Any] = {"band": label, "delta_f": _number(delta[k])}
        if samples is not None and not np.isnan(delta[k]):
            low, high = _interval(samples[:, k])
            kept = samples[:, k][~np.isnan(samples[:, k])]
            side = np.mean(kept <= 0) if delta[k] > 0 else np.mean(kept >= 0)
            row |= {"ci_low": low, "ci_high": high, "p": float(min(1.0, 2 * side))}
        out.append(row)
    return out


def _f_cell(band: Mapping[str, Any]) -> str:
    """``61.2 [58.0, 64.1]``; ``empty`` for a band without words."""
    if band["f"] is None:
        return "empty"
    ci = f" [{band['f_ci_low']:.1f}, {band['f_ci_high']:.1f}]" if band["f_ci_low"] is not None else ""
    return f"{band['f']:.1f}{ci}"


def markdown(reports: Mapping[str, Mapping[str, Any]]) -> str:
    """Word F-measure by training frequency, one column per system (with a ``frequency`` entry);
    a system with a ``frequency_vs_baseline`` entry adds its delta and p-value per band."""
    names = [n for n, r in reports.items() if r.get("frequency")]
    if not names:
        return ""
    first = reports[names[0]]["frequency"]
    lines = ["| training frequency | reference words | " + " | ".join(f"{n} word F [95% CI]" for n in names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    for k, band in enumerate(first):
        cells = [_f_cell(reports[n]["frequency"][k]) for n in names]
        lines.append(f"| {band['band']} | {band['ref_words']} | " + " | ".join(cells) + " |")
    tested = [n for n in names if reports[n].get("frequency_vs_baseline")]
    if tested:
        lines += ["", "| system vs baseline | training frequency | delta word F [95% CI] | p |", "|---|---|---:|---:|"]
        for n in tested:
            test = reports[n]["frequency_vs_baseline"]
            for row in test["rows"]:
                if row["delta_f"] is None:
                    lines.append(f"| {n} vs {test['baseline']} | {row['band']} | empty | |")
                    continue
                ci = f" [{row['ci_low']:+.1f}, {row['ci_high']:+.1f}]" if row.get("ci_low") is not None else ""
                p = f"{row['p']:.3f}" if "p" in row else ""
                lines.append(f"| {n} vs {test['baseline']} | {row['band']} | {row['delta_f']:+.1f}{ci} | {p} |")
    return "\n".join(lines) + "\n"

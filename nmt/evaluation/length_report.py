"""BLEU and chrF (and COMET, where scored) by source-sentence length (Bahdanau et al. 2015, Fig. 2).

Sentences are bucketed by the length of their *source* (words before subword segmentation;
characters for a language written without spaces, such as Chinese or Thai; or the source's own
SentencePiece tokens, ``Tokens``; ``nmt.languages.writing`` says which language is counted how), so every
system is scored on the same sentences in each bucket. ``length_buckets="auto"`` picks the edges
of the unit (``EDGES``). Each
bucket gets corpus BLEU/chrF over its sentences and a 95% bootstrap confidence interval of its
BLEU, and the hypothesis/reference length ratio behind BLEU's brevity penalty (a system that
stops long sentences early shows it there first); an empty bucket is reported as empty, never as
BLEU 0.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np
from sacrebleu.metrics import BLEU, CHRF

from nmt.runs.files import json_text

DEFAULT_EDGES = (10, 20, 30, 40, 50, 60)
# The edges length_buckets=auto picks for each unit. A Chinese word is about 1.5 characters, and
# corpora of short sentences (Tatoeba's Chinese: median 9 characters) need 5-character steps to
# spread: finer edges where most sentences are, then 20-character steps to about the >60 words.
FINE_EDGES = (5, 10, 15, 20, 30, 40, 60, 80, 100)
EDGES = {"words": DEFAULT_EDGES, "chars": FINE_EDGES, "tokens": FINE_EDGES}
UNIT_NAMES = {"words": "words", "chars": "characters", "tokens": "source SentencePiece tokens"}


@dataclass(frozen=True)
class Tokens:
    """The length unit ``tokens``: a source's pieces in its SentencePiece model (``count``: one
    sentence -> its number of pieces), a length comparable across languages."""

    count: Callable[[str], int]

    def __str__(self) -> str:
        return "tokens"


Unit = Union[str, Tokens]  # words | chars | Tokens(...)


def data_unit(datamodule: Any) -> Unit:
    """The unit a data module's sources are counted in: its ``src_words`` (words | chars, resolved
    from ``auto``), or for ``src_words=tokens`` their pieces in its source SentencePiece model."""
    if getattr(datamodule, "src_words_setting", None) == "tokens":
        vocab = datamodule.src_vocab
        return Tokens(lambda text: len(vocab.encode(text)))
    return getattr(datamodule, "src_words", None) or "words"


def length_buckets(edges: Sequence[int] | str | None, unit: Unit = "words") -> tuple[int, ...]:
    """The bucket edges of a ``length_buckets`` setting: ``auto`` (or None) -> ``EDGES`` of the
    unit; a list as given."""
    if edges is None or edges == "auto":
        return EDGES[str(unit)]
    if isinstance(edges, str):
        raise ValueError(f"length_buckets={edges}: give auto or a list of increasing edges, e.g. [10, 20, 30]")
    return tuple(int(e) for e in edges)


@dataclass
class Bucket:
    label: str
    low: int  # inclusive
    high: int | None  # inclusive; None = unbounded
    count: int
    bleu: float | None
    chrf: float | None
    bleu_ci_low: float | None
    bleu_ci_high: float | None
    length_ratio: float | None  # hypothesis / reference length in BLEU's tokens (sacreBLEU's sys_len / ref_len)


def bucket_bounds(edges: Sequence[int]) -> list[tuple[str, int, int | None]]:
    """Edges (10, 20, ..., 60) -> [("1-10", 1, 10), ("11-20", 11, 20), ..., (">60", 61, None)]."""
    if isinstance(edges, str):
        raise ValueError(f"bucket edges: a list, not {edges!r} (resolve it with length_buckets)")
    edges = sorted(int(e) for e in edges)
    if not edges or edges[0] < 1 or len(set(edges)) != len(edges):
        raise ValueError(f"length buckets need increasing positive edges, got {list(edges)}")
    bounds, low = [], 1
    for edge in edges:
        bounds.append((f"{low}-{edge}", low, edge))
        low = edge + 1
    bounds.append((f">{edges[-1]}", low, None))
    return bounds


def source_lengths(sources: Sequence[str], unit: Unit = "words") -> list[int]:
    """Length of each source sentence in words (whitespace), characters (spaces excluded) or
    ``Tokens``."""
    if isinstance(unit, Tokens):
        return [unit.count(s) for s in sources]
    if unit == "words":
        return [len(s.split()) for s in sources]
    if unit == "chars":
        return [len("".join(s.split())) for s in sources]
    if unit == "tokens":
        raise ValueError("length unit 'tokens' needs the source's SentencePiece model: pass Tokens(count)")
    raise ValueError(f"length unit must be 'words', 'chars' or 'tokens', got {unit!r}")


def bucket_indices(sources: Sequence[str], edges: Sequence[int] | str, unit: Unit = "words") -> list[np.ndarray]:
    """Indices of the sentences in each bucket of ``bucket_bounds(edges)``, by source length."""
    lengths = np.array(source_lengths(sources, unit))
    return [np.flatnonzero((lengths >= low) & (lengths <= (high if high is not None else np.inf)))
            for _, low, high in bucket_bounds(length_buckets(edges, unit))]


def sentence_stats(bleu: BLEU, hyps: Sequence[str], refs: Sequence[str]) -> np.ndarray:
    """BLEU's sufficient statistics of each sentence, ``(N, 2 + 2 * max_ngram_order)`` int64:
    hypothesis length, reference length, matching and total n-grams of each order.

    Read from the public ``BLEUScore`` of each sentence scored alone (``sys_len``, ``ref_len``,
    ``counts``, ``totals``); the column sums of any subset are that subset's corpus statistics,
    exactly what ``corpus_score`` sums internally.
    """
    if bleu.smooth_method == "add-k":  # compute_bleu adds k to the counts it returns
        raise ValueError("sentence statistics need a BLEU without add-k smoothing")
    rows = []
    for hyp, ref in zip(hyps, refs):
        s = bleu.corpus_score([hyp], [[ref]])
        rows.append([s.sys_len, s.ref_len, *s.counts, *s.totals])
    return np.array(rows, dtype=np.int64).reshape(len(rows), 2 + 2 * bleu.max_ngram_order)


def bleu_from_stats(bleu: BLEU, totals: np.ndarray) -> float:
    """Corpus BLEU from summed sentence statistics, with ``bleu``'s smoothing (``BLEU.compute_bleu``)."""
    order = bleu.max_ngram_order
    t = [int(x) for x in totals]
    return BLEU.compute_bleu(correct=t[2:2 + order], total=t[2 + order:], sys_len=t[0], ref_len=t[1],
                             smooth_method=bleu.smooth_method, smooth_value=bleu.smooth_value,
                             effective_order=bleu.effective_order, max_ngram_order=order).score


def bootstrap_bleu(bleu: BLEU, stats: np.ndarray, n: int, seed: int) -> tuple[float, float]:
    """95% percentile interval of corpus BLEU over ``n`` resamples of the sentence statistics."""
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(len(stats), np.full(len(stats), 1.0 / len(stats)), size=n)  # (n, N)
    totals = weights @ stats  # (n, num_stats): the statistics of each resampled corpus
    scores = np.array([bleu_from_stats(bleu, t) for t in totals])
    return float(np.percentile(scores, 2.5)), float(np.percentile(scores, 97.5))


def length_report(
    sources: Sequence[str],
    hyps: Sequence[str],
    refs: Sequence[str],
    edges: Sequence[int] | str = "auto",
    unit: Unit = "words",
    tokenize: str | None = None,
    n_bootstrap: int = 1000,
    seed: int = 12345,
) -> dict[str, Any]:
    """Overall and per-bucket scores as a JSON-ready dict (``edges``: ``length_buckets``'s;
    ``tokenize``: sacreBLEU's tokenizer, None for its default, 13a; resolve ``auto`` first,
    ``nmt.languages.writing.resolve_tokenize``)."""
    edges = length_buckets(edges, unit)
    if not len(sources) == len(hyps) == len(refs):
        raise ValueError(f"{len(sources)} sources, {len(hyps)} hypotheses and {len(refs)} references differ in number")
    bleu = BLEU(tokenize=tokenize) if tokenize else BLEU()
    chrf = CHRF()
    stats = sentence_stats(bleu, hyps, refs)

    def score(index: np.ndarray) -> tuple[float, float, float, float, float]:
        h = [hyps[i] for i in index]
        r = [refs[i] for i in index]
        low, high = bootstrap_bleu(bleu, stats[index], n_bootstrap, seed) if n_bootstrap > 1 else (math.nan, math.nan)
        b = bleu.corpus_score(h, [r])
        return b.score, chrf.corpus_score(h, [r]).score, low, high, b.sys_len / max(b.ref_len, 1)

    buckets = []
    for (label, low, high), index in zip(bucket_bounds(edges), bucket_indices(sources, edges, unit)):
        if len(index) == 0:
            buckets.append(Bucket(label, low, high, 0, None, None, None, None, None))
        else:
            buckets.append(Bucket(label, low, high, len(index), *score(index)))
    overall = score(np.arange(len(hyps)))
    return {
        "unit": str(unit),
        "count": len(hyps),
        "bleu": overall[0],
        "chrf": overall[1],
        "bleu_ci": [overall[2], overall[3]],
        "length_ratio": overall[4],
        "buckets": [asdict(b) for b in buckets],
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bootstrap": {"resamples": n_bootstrap, "seed": seed},
    }


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _fmt4(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.4f}"


def bleu_cell(bleu: float, low: float | None, high: float | None) -> str:
    """``38.2 [36.7, 39.8]``, or ``38.2`` without an interval (no bootstrap: None or NaN)."""
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return f"{bleu:.1f}"
    return f"{bleu:.1f} [{low:.1f}, {high:.1f}]"


def comet_cell(value: float | None, low: float | None, high: float | None) -> str:
    """``0.8412 [0.8301, 0.8519]``, the score alone without an interval, ``empty`` for no sentences."""
    if value is None:
        return "empty"
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return f"{value:.4f}"
    return f"{value:.4f} [{low:.4f}, {high:.4f}]"


def _number(value: float | None) -> float:
    return np.nan if value is None else value


def tokenizer_name(signature: str) -> str:
    """The tokenizer of a sacreBLEU signature: ``nrefs:1|...|tok:zh|...`` -> ``zh``."""
    return next((part[4:] for part in signature.split("|") if part.startswith("tok:")), "13a")


def markdown_table(reports: dict[str, dict[str, Any]]) -> str:
    """One row per bucket, a BLEU [95% CI] column per system (then a COMET one per system scored
    with COMET, ``nmt.evaluation.segment_scores``), and the counts."""
    names = list(reports)
    comet = [n for n in names if reports[n].get("comet") is not None]
    first = reports[names[0]]
    unit = first["unit"]
    lines = [
        f"By source length in {UNIT_NAMES.get(unit, unit)}; BLEU on sacreBLEU's "
        f"{tokenizer_name(first['bleu_signature'])} tokens (signature below).",
        "",
        f"| source length ({unit}) | sentences | " + " | ".join(f"{n} BLEU [95% CI]" for n in names)
        + "".join(f" | {n} COMET [95% CI]" for n in comet) + " |",
        "|---|---:|" + "---:|" * (len(names) + len(comet)),
    ]
    for i, bucket in enumerate(first["buckets"]):
        cells = []
        for name in names:
            b = reports[name]["buckets"][i]
            cells.append("empty" if b["count"] == 0 else bleu_cell(b["bleu"], b["bleu_ci_low"], b["bleu_ci_high"]))
        for name in comet:
            b = reports[name]["buckets"][i]
            cells.append(comet_cell(b.get("comet"), b.get("comet_ci_low"), b.get("comet_ci_high")))
        lines.append(f"| {bucket['label']} | {bucket['count']} | " + " | ".join(cells) + " |")
    overall = [bleu_cell(reports[n]["bleu"], *reports[n]["bleu_ci"]) for n in names]
    overall += [comet_cell(reports[n]["comet"], *reports[n]["comet_ci"]) for n in comet]
    lines.append(f"| all | {first['count']} | {' | '.join(overall)} |")
    lines.append("")
    lines.append(f"sacreBLEU: `{first['bleu_signature']}`")
    if comet:
        lines.append(f"COMET (Rei et al. 2020; the mean of segment scores): `{reports[comet[0]]['comet_settings'].get('model')}`")
    return "\n".join(lines) + "\n"


def plot_bleu_by_length(reports: dict[str, dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """BLEU per source-length bucket, one curve per system, CI as error bars, counts on the axis."""
    from nmt.evaluation.plots import figure, save

    first = next(iter(reports.values()))
    labels = [f"{b['label']}\n(n={b['count']})" for b in first["buckets"]]
    x = np.arange(len(labels))
    fig, ax = figure(max(6.0, 0.9 * len(labels) + 2), 4.2)
    for name, report in reports.items():
        ys = np.array([np.nan if b["bleu"] is None else b["bleu"] for b in report["buckets"]])
        lo = np.array([np.nan if b["bleu"] is None else b["bleu"] - _number(b["bleu_ci_low"]) for b in report["buckets"]])
        hi = np.array([np.nan if b["bleu"] is None else _number(b["bleu_ci_high"]) - b["bleu"] for b in report["buckets"]])
        ax.errorbar(x, ys, yerr=[lo, hi], marker="o", capsize=3, label=f"{name} ({report['bleu']:.1f})")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_xlabel(f"source sentence length ({UNIT_NAMES.get(first['unit'], first['unit'])})")
    ax.set_ylabel("BLEU")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, ax, path, title)


def write_report(report: dict[str, Any], out_dir: str | Path, name: str = "model", stem: str = "bleu_by_length") -> dict[str, Path]:
    """Write ``<stem>.json``, ``.csv``, ``.md`` and ``.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "csv", "md", "png")}
    paths["json"].write_text(json_text(report))
    with paths["csv"].open("w", newline="") as f:
        writer = csv.writer(f)
        comet = report.get("comet") is not None  # COMET columns (nmt.evaluation.segment_scores) when scored
        writer.writerow(["bucket", "low", "high", "count", "bleu", "chrf", "bleu_ci_low", "bleu_ci_high", "length_ratio",
                         *(["comet", "comet_ci_low", "comet_ci_high"] if comet else [])])
        for b in report["buckets"]:
            writer.writerow([b["label"], b["low"], b["high"] if b["high"] is not None else "", b["count"],
                             _fmt(b["bleu"]), _fmt(b["chrf"]), _fmt(b["bleu_ci_low"]), _fmt(b["bleu_ci_high"]),
                             _fmt(b.get("length_ratio")),
                             *([_fmt4(b["comet"]), _fmt4(b["comet_ci_low"]), _fmt4(b["comet_ci_high"])] if comet else [])])
        writer.writerow(["all", "", "", report["count"], _fmt(report["bleu"]), _fmt(report["chrf"]),
                         _fmt(report["bleu_ci"][0]), _fmt(report["bleu_ci"][1]), _fmt(report.get("length_ratio")),
                         *([_fmt4(report["comet"]), *map(_fmt4, report["comet_ci"])] if comet else [])])
    paths["md"].write_text(markdown_table({name: report}))
    plot_bleu_by_length({name: report}, paths["png"])
    return paths

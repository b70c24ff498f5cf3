"""What a translator returns, and how it is written: one ``Translation`` per input line (its
hypotheses best first), turned into the rows of each output format here and only here
(``translate``'s text, TSV and JSON lines, ``serve``'s JSON). No torch here: the CTranslate2
backend returns the same objects.

Rows of one line (``number`` counts from 1):
- text: the best hypothesis' text;
- JSON line of a translation: ``{"line", "text", "score"}``;
- n-best (k rows a line): ``line <TAB> rank <TAB> score <TAB> logprob <TAB> text`` or the same keys
  as JSON; ``score`` is what beam search ranks by (``logprob / ((5 + n) / 6) ** alpha``, n the
  tokens with EOS), ``logprob`` the sum of the tokens' log-probabilities; missing ranks (fewer
  hypotheses than k, an empty line) are rows with empty text and scores 0;
- scores of given pairs: ``logprob <TAB> mean <TAB> tokens [<TAB> per-token values]``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Hypothesis:
    text: str
    score: float  # what the search ranks by (beam search: logprob / GNMT length penalty)
    logprob: float  # the sum of the tokens' log-probabilities, EOS included
    alignment: str | None = None  # Pharaoh word alignment "0-0 1-2 ..." (decoding.alignments=true)


@dataclass
class Attention:
    source: list[str]  # source pieces, EOS included
    target: list[str]  # target pieces, EOS included
    weights: list[list[float]]  # (target, source)


@dataclass
class Translation:
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first; empty for an empty line
    attention: Attention | None = None

    @property
    def text(self) -> str:
        return self.hypotheses[0].text if self.hypotheses else ""

    @property
    def score(self) -> float:
        return self.hypotheses[0].score if self.hypotheses else 0.0


def in_line_order(batches: Iterable[list[tuple[int, T]]], lines: int, empty: Callable[[], T]) -> list[T]:
    """The items of ``batches`` (lists of ``(line index, item)``, in any order) as one list in line
    order; a line no batch holds (an empty line) gets ``empty()``."""
    out = [empty() for _ in range(lines)]
    for batch in batches:
        for i, item in batch:
            out[i] = item
    return out


def score_of(value: float) -> float | None:
    """A score for JSON: rounded to 4 places, or None (null) where it is not finite (a forced
    token the model gives no probability): JSON has no NaN or infinity."""
    return round(value, 4) if math.isfinite(value) else None


FORMATS = {"translate": ("text", "jsonl"), "nbest": ("tsv", "jsonl"), "score": ("tsv", "jsonl")}


def output_format(fmt: str, mode: str, nbest: int) -> str:
    """``format=auto`` resolved (text; tsv for n-best lists and scores), or a ValueError for a
    format the mode cannot write."""
    kind = "score" if mode == "score" else "nbest" if nbest > 1 else "translate"
    allowed = FORMATS[kind]
    if fmt == "auto":
        return allowed[0]
    if fmt not in allowed:
        what = {"score": "scoring", "nbest": "n-best lists", "translate": "translations"}[kind]
        raise ValueError(f"format={fmt}: choose auto or one of {', '.join(allowed)} for {what}")
    return fmt


def translation_rows(number: int, translation: Translation, fmt: str, nbest: int = 1,
                     alignments: bool = False) -> list[str]:
    """The output rows of input line ``number``: one, or ``nbest`` ranked ones; with
    ``alignments``, each hypothesis' Pharaoh alignment follows its text (after a tab; JSON:
    ``"alignment"``), empty for an empty line."""
    if nbest <= 1:
        best = translation.hypotheses[0] if translation.hypotheses else Hypothesis("", 0.0, 0.0)
        if fmt == "jsonl":
            row = {"line": number, "text": best.text, "score": score_of(best.score)}
            return [json.dumps(row | ({"alignment": best.alignment or ""} if alignments else {}), ensure_ascii=False)]
        return [best.text + (f"\t{best.alignment or ''}" if alignments else "")]
    rows = []
    for rank in range(1, nbest + 1):
        hyp = translation.hypotheses[rank - 1] if rank <= len(translation.hypotheses) else Hypothesis("", 0.0, 0.0)
        if fmt == "jsonl":
            row = {"line": number, "rank": rank, "score": score_of(hyp.score), "logprob": score_of(hyp.logprob),
                   "text": hyp.text}
            rows.append(json.dumps(row | ({"alignment": hyp.alignment or ""} if alignments else {}), ensure_ascii=False))
        else:
            rows.append(f"{number}\t{rank}\t{hyp.score:.4f}\t{hyp.logprob:.4f}\t{hyp.text}"
                        + (f"\t{hyp.alignment or ''}" if alignments else ""))
    return rows


def score_row(number: int, values: list[float] | None, fmt: str, per_token: bool) -> str:
    """The row of a scored pair; ``values`` its per-token log-probabilities (None: an empty source)."""
    if values is None:
        return json.dumps({"line": number}) if fmt == "jsonl" else ""
    total = sum(values)
    if fmt == "jsonl":
        row: dict[str, Any] = {"line": number, "logprob": score_of(total), "mean": score_of(total / len(values)),
                               "tokens": len(values)}
        if per_token:
            row["token_logprobs"] = [score_of(v) for v in values]
        return json.dumps(row)
    row_text = f"{total:.4f}\t{total / len(values):.4f}\t{len(values)}"
    return row_text + ("\t" + " ".join(f"{v:.4f}" for v in values) if per_token else "")


def response_item(translation: Translation, nbest: int, attention: bool) -> dict[str, Any]:
    """One sentence of the server's answer: ``{"text", "score", "alignment"?, "nbest"?, "attention"?}``
    (``alignment``: when the translator aligned it, ``decoding.alignments``)."""
    item: dict[str, Any] = {"text": translation.text, "score": score_of(translation.score)}
    aligned = bool(translation.hypotheses) and translation.hypotheses[0].alignment is not None
    if aligned:
        item["alignment"] = translation.hypotheses[0].alignment
    if nbest > 1:
        item["nbest"] = [{"text": h.text, "score": score_of(h.score), **({"alignment": h.alignment} if aligned else {})}
                         for h in translation.hypotheses]
    if attention and translation.attention is not None:
        a = translation.attention
        item["attention"] = {"source": a.source, "target": a.target,
                             "weights": [[round(w, 4) for w in row] for row in a.weights]}
    return item

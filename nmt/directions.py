"""A multilingual test set, direction by direction: BLEU by length and the wrong-language rate.

The test split of a multilingual source (`nmt.data.multilingual`) holds each pair's direction
(its origin). `direction_reports` splits a system's translations by direction and gives each its
BLEU-by-length report (`nmt.length_report`, on the source without its tag) and its wrong-language
rate: the share of non-empty translations that the language identifier (`nmt.language_id`,
restricted to the languages of the model's directions) does not put in the direction's target
language. The same rate of the references is the identifier's own error on that data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from nmt.language_id import identify
from nmt.languages import split_tag
from nmt.length_report import length_report


def untagged(sources: Sequence[str]) -> list[str]:
    """The sources without their leading target-language tag."""
    return [split_tag(s)[1] for s in sources]


def wrong_language(texts: Sequence[str], expected: str, languages: Sequence[str]) -> dict[str, Any]:
    """How many of the non-empty ``texts`` are identified as another of ``languages`` than ``expected``."""
    found = identify(texts, languages)
    said = [f for f in found if f is not None]
    wrong = sum(1 for f in said if f != expected)
    return {"rate": wrong / len(said) if said else 0.0, "wrong": wrong, "identified": len(said),
            "empty": len(found) - len(said), "languages": dict(Counter(said).most_common())}


def direction_reports(sources: Sequence[str], hyps: Sequence[str], refs: Sequence[str], origins: np.ndarray,
                      names: Sequence[str], zero_shot: Sequence[str], **report: Any) -> dict[str, dict[str, Any]]:
    """Per direction ``"de-fr"``: its length report (``report``: ``length_report``'s options) with
    ``kind`` (supervised or zero-shot), ``wrong_language`` and ``reference_wrong_language``."""
    languages = sorted({lang for name in names for lang in name.split("-")})
    out = {}
    for d, name in enumerate(names):
        rows = np.flatnonzero(origins == d)
        if not len(rows):
            continue
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        target = name.split("-")[1]
        result = length_report(untagged(pick(sources)), pick(hyps), pick(refs), **report)
        result["kind"] = "zero-shot" if name in zero_shot else "supervised"
        result["wrong_language"] = wrong_language(pick(hyps), target, languages)
        result["reference_wrong_language"] = wrong_language(pick(refs), target, languages)
        out[name] = result
    return out


def longest_bucket(report: dict[str, Any]) -> dict[str, Any] | None:
    """The report's longest source-length bucket that holds sentences."""
    return next((b for b in reversed(report["buckets"]) if b["count"]), None)


def markdown(systems: dict[str, dict[str, dict[str, Any]]]) -> str:
    """One table: a row per system and direction (BLEU with its 95% interval, chrF, the longest
    populated length bucket, the wrong-language rates of the translations and the references)."""
    lines = ["| system | direction | kind | pairs | BLEU [95% CI] | chrF | longest bucket: BLEU (pairs) | "
             "wrong language | references' |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for system, directions in systems.items():
        for name, r in directions.items():
            long = longest_bucket(r)
            cell = f"{long['label']}: {long['bleu']:.1f} ({long['count']})" if long else "-"
            lines.append(f"| {system} | {name} | {r['kind']} | {r['count']} | {r['bleu']:.1f} "
                         f"[{r['bleu_ci'][0]:.1f}, {r['bleu_ci'][1]:.1f}] | {r['chrf']:.1f} | {cell} | "
                         f"{100 * r['wrong_language']['rate']:.1f}% | "
                         f"{100 * r['reference_wrong_language']['rate']:.1f}% |")
    return "\n".join(lines) + "\n"

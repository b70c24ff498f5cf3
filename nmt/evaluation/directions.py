"""A multilingual test set, direction by direction: BLEU by length and the wrong-language rate.

The test split of a multilingual source (`nmt.data.multilingual`) holds each pair's direction
(its origin). `direction_reports` splits a system's translations by direction and gives each its
BLEU-by-length report (`nmt.evaluation.length_report`, on the source without its tag) and its wrong-language
rate: the share of non-empty translations that the language identifier (`nmt.evaluation.language_id`,
restricted to the languages of the model's directions) does not put in the direction's target
language. The same rate of the references is the identifier's own error on that data. A length
unit or BLEU tokenizer set to ``auto`` follows each direction's own languages (``nmt.languages.writing``):
a zh-en direction counts its sources in characters, an en-zh one scores BLEU with sacreBLEU's zh.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nmt.languages import writing
from nmt.evaluation.language_id import identifier, identify
from nmt.languages.tags import split_tag
from nmt.inference.requests import Naming, Request, RequestError
from nmt.evaluation.length_report import data_unit, length_report, write_report
from nmt.runs.files import json_text

log = logging.getLogger(__name__)


def untagged(sources: Sequence[str]) -> list[str]:
    """The sources without their leading target-language tag."""
    return [split_tag(s)[1] for s in sources]


@dataclass
class Plan:
    """How a test split divides: ``names`` of its directions, each pair's index into them
    (``origins``; None: one direction, the data config's), the test-only ones, and whether the
    language identifier knows their languages (else no wrong-language rate)."""

    names: list[str]
    origins: np.ndarray | None
    zero_shot: list[str]
    identify: bool


def plan(datamodule: Any) -> Plan | None:
    """The ``Plan`` of a data module's test split: its directions when it has several, else its
    one direction when the language identifier knows both languages, else None (e.g. synthetic)."""
    origins = datamodule.origins.get("test")
    if origins is None:
        result = Plan([f"{datamodule.src_lang}-{datamodule.tgt_lang}"], None, [], True)
    else:
        result = Plan(list(datamodule.origin_names), origins, list(getattr(datamodule.source, "zero_shot", [])), True)
    languages = tuple(sorted({lang for name in result.names for lang in name.split("-")}))
    try:
        identifier(languages)
    except (ValueError, ImportError) as e:
        if origins is None:
            return None
        log.warning("no wrong-language rate by direction: %s", e)
        result.identify = False
    return result


def model_inputs(translator: Any, name: str, tagged: list[str], sources: list[str], datamodule: Any) -> list[str]:
    """The test sources as ``translator`` reads them (its ``prepare``): untagged for a model of one
    direction; for a multilingual model the split's own tags (each checked against the model's
    languages), or, on data of one direction, the tag of the data's target language; a
    ``RequestError`` naming ``name`` when the model does not translate into it. A model that reads
    both languages reads the untagged sources, with ``request_languages``."""
    languages = translator.target_languages
    if not languages or translator.decoder_languages:  # the latter's languages: request_languages
        return sources
    naming = Naming(item="test pair", tgt_lang=f"ckpts: {name}")
    if datamodule.origins.get("test") is not None:
        return translator.prepare(Request(tagged), naming).sources
    if datamodule.tgt_lang not in languages:
        raise RequestError(f"ckpts: {name} is multilingual (into {', '.join(languages)}), but its test data are "
                           f"{datamodule.src_lang}-{datamodule.tgt_lang}: evaluate it on data in its languages")
    return translator.prepare(Request(sources, datamodule.tgt_lang), naming).sources


# How a system is asked for a split's translations: groups of (the split's rows, the languages they are
# translated with: src_lang and tgt_lang of a model that reads both, {} for the others).
Asked = list[tuple[list[int], dict[str, str]]]


def request_languages(translator: Any, name: str, sources: list[str], datamodule: Any, src_lang: str | None,
                      tgt_lang: str | None) -> Asked:
    """How ``translator`` is asked for the translations of the untagged ``sources``: every row at once
    with no languages for a model that takes the split's tags or none; for a model that reads both
    languages (``decoder_languages``: an imported M2M100, NLLB-200 or mBART-50, or a checkpoint
    fine-tuned from one) with ``src_lang`` and ``tgt_lang`` on a split of one direction, and on a
    split of several each direction's rows with its own two languages (the direction's name, in the
    model's codes). Checked against its codes before any translation: a ``RequestError`` naming
    ``name`` (and the direction), for a language missing or unknown, or ``src_lang``/``tgt_lang``
    given for a split of several directions."""
    every = list(range(len(sources)))
    if not translator.decoder_languages:
        return [(every, {})]
    origins = datamodule.origins.get("test")
    if origins is None:
        try:
            translator.prepare(Request(sources, tgt_lang, src_lang=src_lang), Naming(item="test pair"))
        except RequestError as e:
            raise RequestError(f"ckpts: {name}: {e}") from None
        return [(every, {"src_lang": str(src_lang), "tgt_lang": str(tgt_lang)})]
    if src_lang is not None or tgt_lang is not None:
        raise RequestError(f"ckpts: {name}: src_lang, tgt_lang: the test split has several directions "
                           f"({', '.join(datamodule.origin_names)}), each translated from and into its own languages; "
                           "leave src_lang and tgt_lang unset")
    asked: Asked = []
    for d, direction in enumerate(datamodule.origin_names):
        rows = np.flatnonzero(origins == d).tolist()
        if not rows:
            continue
        src, tgt = direction.split("-")
        try:
            translator.prepare(Request([sources[i] for i in rows], tgt, src_lang=src),
                               Naming(numbers=[i + 1 for i in rows], item="test pair"))
        except RequestError as e:
            raise RequestError(f"ckpts: {name}: the test split's direction {direction}: {e}") from None
        asked.append((rows, {"src_lang": src, "tgt_lang": tgt}))
    return asked


def wrong_language(texts: Sequence[str], expected: str, languages: Sequence[str]) -> dict[str, Any]:
    """How many of the non-empty ``texts`` are identified as another of ``languages`` than ``expected``."""
    found = identify(texts, languages)
    said = [f for f in found if f is not None]
    wrong = sum(1 for f in said if f != expected)
    return {"rate": wrong / len(said) if said else 0.0, "wrong": wrong, "identified": len(said),
            "empty": len(found) - len(said), "languages": dict(Counter(said).most_common())}


def report_options(datamodule: Any, edges: Any, tokenize: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``length_report``'s options for a data module's split, from the ``length_buckets`` and
    ``sacrebleu_tokenize`` settings: the whole split's (its unit; ``auto`` tokenizes for its target
    language), and those its directions resolve each for themselves (``direction_options``)."""
    unit = data_unit(datamodule)
    whole = {"edges": edges, "unit": unit, "tokenize": writing.resolve_tokenize(tokenize, datamodule.tgt_lang)}
    own = getattr(datamodule, "src_words_setting", None) == "auto"
    return whole, {"edges": edges, "unit": "auto" if own else unit, "tokenize": tokenize}


def direction_options(name: str, sources: Sequence[str], report: dict[str, Any]) -> dict[str, Any]:
    """``report`` (``length_report``'s options) for the direction ``name`` ("zh-en") and its
    untagged ``sources``: a unit or tokenizer given as ``auto`` follows its languages."""
    src, tgt = name.split("-")
    unit = report.get("unit", "words")
    return {**report, "unit": writing.length_unit(src, sources) if unit == "auto" else unit,
            "tokenize": writing.resolve_tokenize(report.get("tokenize"), tgt)}


SCORES = ("unit", "count", "bleu", "chrf", "bleu_ci", "length_ratio", "buckets", "bleu_signature")


def direction_reports(plan: Plan, sources: Sequence[str], hyps: Sequence[str], refs: Sequence[str],
                      whole: dict[str, Any] | None = None, **report: Any) -> dict[str, dict[str, Any]]:
    """Per direction ``"de-fr"``: its length report (``report``: ``length_report``'s options; for a
    split of one direction the ``whole`` split's report) with ``kind`` (supervised or zero-shot),
    ``wrong_language`` and ``reference_wrong_language`` (None where the identifier cannot tell)."""
    languages = sorted({lang for name in plan.names for lang in name.split("-")})
    out = {}
    for d, name in enumerate(plan.names):
        rows = np.arange(len(refs)) if plan.origins is None else np.flatnonzero(plan.origins == d)
        if not len(rows):
            continue
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        target = name.split("-")[1]
        if plan.origins is None and whole is not None:
            result = {key: whole[key] for key in SCORES if key in whole}
        else:
            own = untagged(pick(sources))
            result = length_report(own, pick(hyps), pick(refs), **direction_options(name, own, report))
        result["kind"] = "zero-shot" if name in plan.zero_shot else "supervised"
        result["wrong_language"] = wrong_language(pick(hyps), target, languages) if plan.identify else None
        result["reference_wrong_language"] = wrong_language(pick(refs), target, languages) if plan.identify else None
        out[name] = result
    return out


def write_direction_reports(plan: Plan, sources: Sequence[str], hyps: dict[str, Sequence[str]], refs: Sequence[str],
                            out_dir: Path, reports: dict[str, dict[str, Any]] | None = None, per_direction: bool = False,
                            **report: Any) -> dict[str, Any]:
    """Each system's ``direction_reports`` (``hyps``: system -> its translations of the tagged
    ``sources``; ``reports``: its whole-split length report, if made) in ``directions.{json,md}``
    and, with ``per_direction`` on a split of several directions, a length report per system and
    direction (``<system>.<direction>/``); the table, which is also logged."""
    table = {name: direction_reports(plan, sources, h, refs, (reports or {}).get(name), **report)
             for name, h in hyps.items()}
    if per_direction and plan.origins is not None:
        for name, by_direction in table.items():
            for direction, result in by_direction.items():
                write_report(result, out_dir / f"{name}.{direction}", name=f"{name} ({direction})")
    (out_dir / "directions.json").write_text(json_text(table))
    (out_dir / "directions.md").write_text(markdown(table))
    log.info("by direction -> %s\n%s", out_dir / "directions.md", markdown(table))
    return table


def longest_bucket(report: dict[str, Any]) -> dict[str, Any] | None:
    """The report's longest source-length bucket that holds sentences."""
    return next((b for b in reversed(report["buckets"]) if b["count"]), None)


def _rate(found: dict[str, Any] | None) -> str:
    return "-" if not found or not found["identified"] else f"{100 * found['rate']:.1f}%"


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
                         f"{_rate(r['wrong_language'])} | {_rate(r['reference_wrong_language'])} |")
    return "\n".join(lines) + "\n"

"""The analyses of a scored split beyond length, one function each, filling each system's report:
COMET by length with its paired test, word F-measure by training frequency, BLEU by reordering
distance (from gold or forced alignments), attention entropy, BLEU on augmented copies of the
test set (robustness), and what each attention head does (``by_heads``)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig

from nmt.languages import writing
from nmt.evaluation import reordering, segment_scores, word_frequency
from nmt.evaluation.directions import Asked
from nmt.evaluation.length_report import (Unit, bleu_cell, bucket_bounds, bucket_indices, length_report, source_lengths,
                                          write_report)
from nmt.evaluation.significance import significance
from nmt.inference.translator import encode_sources
from nmt.languages.tags import split_tag, tag
from nmt.runs.files import json_text

log = logging.getLogger(__name__)


@dataclass
class Scored:
    """What every analysis reads: the split's sources (untagged and as stored), references and
    length unit, each system's hypotheses, the system the others are tested against, the length
    buckets' edges, sacreBLEU's tokenizer (resolved: no ``auto``) and the unit the source's and
    the target's words are counted in where an analysis places words (``words_of``)."""

    sources: list[str]
    tagged: list[str]
    refs: list[str]
    unit: Unit
    hyps: dict[str, list[str]]
    baseline: str
    edges: Sequence[int]
    tokenize: str | None
    words: tuple[str, str] = ("words", "words")


def words_of(lang: str, texts: Sequence[str]) -> str:
    """The unit a word of ``lang`` is counted in: ``nmt.languages.writing``'s (chars for a language written
    without spaces, such as Chinese or Thai), judged from ``texts`` for a code it does not list."""
    known = writing.writing(lang)
    return known.unit if known is not None else writing.text_unit(texts)


def training_counts(datamodule: Any, tokenize: str | None = None, chunk: int = 50_000) -> Counter[str]:
    """Word counts of the target side of the pairs the data config trains on (read in chunks), in
    the words BLEU scores the target language in (sacreBLEU's ``tokenize``, resolved)."""
    from nmt.data.prepare import TextColumn

    column, index = TextColumn(datamodule.prepared_dir, "train.tgt"), datamodule.train_rows()
    total: Counter[str] = Counter()
    for start in range(0, len(index), chunk):
        total.update(word_frequency.counts(column.take(index[start : start + chunk]), tokenize))
    return total


def asked_rows(asked: Asked | None, count: int) -> Asked:
    """``asked`` (``nmt.evaluation.directions.request_languages``), or all ``count`` rows at once with no languages."""
    return asked or [(list(range(count)), {})]


def translate_with_entropy(translator: Any, sources: list[str], attention: bool,
                           asked: Asked | None = None) -> tuple[list[str], list[float | None]]:
    """Each source's translation and, with ``attention``, the entropy of its attention
    (``nmt.evaluation.reordering.sentence_entropy``; None without attention), a batch's weights dropped
    once read, so memory does not grow with the test set. ``asked``: the rows translated together and
    their ``src_lang`` and ``tgt_lang`` for a model that reads both (each direction of a split its own,
    ``nmt.evaluation.directions.request_languages``)."""
    texts, entropy = [""] * len(sources), [None] * len(sources)
    for rows, languages in asked_rows(asked, len(sources)):  # a direction's rows follow one another
        if not rows:
            continue
        for batch in translator.batches([sources[i] for i in rows], attention=attention, first_line=rows[0] + 1,
                                        **languages):
            for j, translation in batch:
                texts[rows[j]] = translation.text
                if translation.attention is not None:
                    entropy[rows[j]] = reordering.sentence_entropy(translation.attention.weights)
    return texts, entropy


def reference_alignments(datamodule: Any, translators: dict[str, Any], sources: list[str], refs: list[str],
                         inputs: dict[str, list[str]], units: tuple[str, str] = ("words", "words"),
                         ) -> tuple[str, list[set[tuple[int, int]]], tuple[str, str]] | None:
    """Word alignments of the test pairs, where they come from and the units they count (source,
    target): the synthetic generator's gold ones (in words), else the forced alignment of the
    references by the first checkpoint with attention, reading the sources as it translates them
    (``inputs``: with a multilingual model's tags), in ``units`` (``Scored.words``: characters for
    a language written without spaces); None when there is neither."""
    from nmt.inference.alignments import parse
    from nmt.data.sources import SyntheticSource
    from nmt.data.synthetic import gold_alignment

    if isinstance(datamodule.source, SyntheticSource):
        return "gold", [parse(gold_alignment(s)) for s in sources], ("words", "words")
    for name, translator in translators.items():
        if translator.has_attention:
            links = []
            for start in range(0, len(sources), 256):
                part = slice(start, start + 256)
                src_ids = encode_sources(inputs[name][part], translator.src_vocab, translator.max_src_len)
                tgt_ids = [t[:-1] for t in encode_sources(refs[part], translator.tgt_vocab, translator.max_tgt_len)]
                links += [parse(a) for a in translator.alignments(src_ids, tgt_ids, units=units)]
            return f"{name}'s forced", links, units
    return None


def by_comet(cfg: DictConfig, test: Scored, reports: dict[str, dict[str, Any]], comet: Any) -> None:
    """COMET of every system (``comet``: a loaded ``nmt.evaluation.comet.Comet``), overall and by
    length with bootstrap intervals, and paired against the baseline (``nmt.evaluation.segment_scores``)."""
    scores = {name: comet.score(test.sources, h, test.refs) for name, h in test.hyps.items()}
    for name, values in scores.items():
        segment_scores.add_to_report(reports[name], values, test.sources, test.edges, unit=test.unit,
                                     n_bootstrap=cfg.n_bootstrap, about=comet.describe())
        reports[name]["comet_segments"] = [float(v) for v in values]
    if len(scores) > 1:
        buckets = list(zip([label for label, _, _ in bucket_bounds(test.edges)],
                           bucket_indices(test.sources, test.edges, test.unit)))
        for name, result in segment_scores.paired(scores, test.hyps, test.baseline, buckets, **cfg.significance).items():
            reports[name]["comet_vs_baseline"] = result


def by_frequency(cfg: DictConfig, test: Scored, frequency: Counter[str], reports: dict[str, dict[str, Any]]) -> None:
    """Word F-measure by training frequency per system (``frequency``: ``training_counts`` in the
    same tokenizer), and paired against the baseline (``nmt.evaluation.word_frequency``); words are
    sacreBLEU's tokens of the target language (``test.tokenize``)."""
    for name, h in test.hyps.items():
        reports[name]["frequency"] = word_frequency.bands(h, test.refs, frequency, n_bootstrap=cfg.n_bootstrap,
                                                          tokenize=test.tokenize)
    for name in test.hyps:
        if len(test.hyps) > 1 and name != test.baseline:
            reports[name]["frequency_vs_baseline"] = {"baseline": test.baseline, "rows": word_frequency.paired(
                test.hyps[name], test.hyps[test.baseline], test.refs, frequency,
                n_bootstrap=int(cfg.significance.bootstrap), tokenize=test.tokenize)}


def by_reordering(cfg: DictConfig, test: Scored, aligned: tuple[str, list[Any], tuple[str, str]] | None,
                  reports: dict[str, dict[str, Any]]) -> None:
    """BLEU by reordering distance per system, from the reference alignments ``aligned`` (their
    origin, the links, their units; None: no alignments, no analysis), with paired tests per
    distance bucket. Sentence lengths are counted in the links' units (characters for Chinese)."""
    if aligned is None:
        return
    src_unit, tgt_unit = aligned[2]
    distances = [reordering.reordering_distance(links, src, tgt) for links, src, tgt in
                 zip(aligned[1], source_lengths(test.sources, src_unit), source_lengths(test.refs, tgt_unit))]
    for name, h in test.hyps.items():
        reports[name]["reordering"] = reordering.bleu_by_reordering(h, test.refs, distances,
                                                                    tokenize=test.tokenize,
                                                                    n_bootstrap=cfg.n_bootstrap)
        reports[name]["reordering_alignments"] = aligned[0]
        reports[name]["reordering_units"] = [src_unit, tgt_unit]  # the distance counts the source's
    if len(test.hyps) > 1:
        buckets = list(zip(reordering.reordering_labels(), reordering.reordering_buckets(distances)))
        tests = significance(test.hyps, test.sources, test.refs, test.baseline, test.edges, unit=test.unit,
                             tokenize=test.tokenize, buckets=buckets, **cfg.significance)
        for name, result in tests.items():
            reports[name]["reordering_vs_baseline"] = result


def robustness(cfg: DictConfig, translators: dict[str, Any], variants: list[str], test: Scored,
               inputs: dict[str, list[str]], reports: dict[str, dict[str, Any]], out_dir: Path,
               languages: dict[str, Asked] | None = None) -> Path:
    """Each checkpoint on augmented copies of the test set (``nmt.data.augment.augmented_copy``:
    ``upper`` in capitals, both sides; ``noise``: typing errors in the sources): a report per
    system and copy (``<name>.<variant>/``) and ``robustness.{json,md}``, BLEU beside the clean set's.
    ``inputs``: each system's sources as it reads them (with its language tags); ``languages``: how
    a system that reads both languages is asked (``translate_with_entropy``'s ``asked``)."""
    from nmt.data.augment import augmented_copy

    sources, refs = test.sources, test.refs
    langs = {name: [split_tag(read)[0] for read in inputs[name]] for name in translators}  # each pair's tag, if any
    table = {name: {"clean": {"bleu": reports[name]["bleu"], "bleu_ci": reports[name]["bleu_ci"],
                              "chrf": reports[name]["chrf"]}} for name in translators}
    for variant in variants:
        copy_sources, copy_refs = augmented_copy(variant, sources, refs, seed=int(cfg.seed))
        for name, translator in translators.items():
            read = [s if lang is None else f"{tag(lang)} {s}" for lang, s in zip(langs[name], copy_sources)]
            hyps = translate_with_entropy(translator, read, False, (languages or {}).get(name))[0]
            (out_dir / f"{name}.{variant}.hyp.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
            report = length_report(copy_sources, hyps, copy_refs, test.edges, unit=test.unit,
                                   tokenize=test.tokenize, n_bootstrap=cfg.n_bootstrap)
            write_report(report, out_dir / f"{name}.{variant}", name=f"{name} ({variant})")
            table[name][variant] = {k: report[k] for k in ("bleu", "bleu_ci", "chrf")}
    (out_dir / "robustness.json").write_text(json_text(table))
    columns = ["clean", *variants]
    lines = ["| system | " + " | ".join(f"{c} BLEU [95% CI]" for c in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for name, row in table.items():
        cells = [bleu_cell(row[c]["bleu"], *row[c]["bleu_ci"]) for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    path = out_dir / "robustness.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def check_head_options(options: Any) -> int:
    """The number of pairs ``head_analysis`` reads; a one-line ValueError naming a bad key."""
    from nmt.evaluation.heads import COLUMNS

    n = options.pairs
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"head_analysis.pairs={n!r}: the number of pairs read, at least 1")
    if options.figure not in COLUMNS:
        raise ValueError(f"head_analysis.figure={options.figure}: choose one of {', '.join(COLUMNS)}")
    return n


def by_heads(cfg: DictConfig, translators: dict[str, Any], test: Scored, inputs: dict[str, list[str]], datamodule: Any,
             out_dir: Path) -> dict[str, Path]:
    """The per-head table and figure (``nmt.evaluation.heads``) of each checkpoint with Transformer
    attention, on the first ``head_analysis.pairs`` pairs, in its report folder (``<name>/heads.*``);
    the cross-attention heads' AER against the synthetic corpus's gold alignments (other corpora
    have none: no AER). Returns each analysed system's markdown table."""
    from nmt.data.sources import SyntheticSource
    from nmt.data.synthetic import gold_alignment
    from nmt.evaluation import heads
    from nmt.inference.alignments import parse

    options = cfg.head_analysis
    n = check_head_options(options)
    gold = [parse(gold_alignment(s)) for s in test.sources[:n]] if isinstance(datamodule.source, SyntheticSource) else None
    written = {}
    for name, translator in translators.items():
        if not heads.has_heads(translator.model):
            log.info("%s: no Transformer attention heads to analyse", name)
            continue
        rows = heads.analyse(translator, inputs[name][:n], test.refs[:n], gold, rare_share=float(options.rare_share),
                             with_importance=bool(options.importance))
        written[name] = heads.write(rows, out_dir / name, name, stat=str(options.figure))["md"]
    return written

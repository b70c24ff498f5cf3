"""Score checkpoints or hypothesis files on a test split, overall and by source length.

    python evaluate.py ckpts=[runA/checkpoints/last.ckpt,runB/checkpoints/last.ckpt]
    python evaluate.py 'ckpts={final: run/checkpoints/last.ckpt, averaged: run/checkpoints/average_last5.ckpt}'
    python evaluate.py data=europarl_it_en 'hyps={lstm: lstm.txt, transformer: tf.txt}' baseline=lstm

With several systems: one comparison table (markdown, CSV, JSON) and one plot with a curve per
system, all scored on the same sentences per bucket, and every system tested against the baseline
(``baseline=``, default the first) with sacreBLEU's paired bootstrap and approximate randomisation,
overall and per bucket (``nmt/evaluation/significance.py``). Without ``data=``, the test split is the one the
first checkpoint was trained on.
"""

from __future__ import annotations

import csv
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from nmt import CONF_DIR, register_resolvers
from nmt.cli_io import ending_cleanly
from nmt.checkpoints import file_config
from nmt.evaluation import directions, reordering, word_frequency
from nmt.checkpoints.files import CheckpointError, saved_vocabularies
from nmt.inference.translator import Translator, encode_sources
from nmt.languages import split_tag, tag
from nmt.evaluation.length_report import length_report, markdown_table, plot_bleu_by_length, write_report
from nmt.evaluation.significance import significance, significance_table
from nmt.text_lines import read_lines
from nmt.runs.files import json_text

log = logging.getLogger(__name__)


def system_name(ckpt: Path) -> str:
    """``<run>/checkpoints/x.ckpt`` -> the run's model preset and folder name."""
    run = ckpt.parent.parent
    return run.parent.parent.name if run.parent.name in ("runs", "multiruns") else run.name


def load_test_split(data_cfg: DictConfig | dict, source: str | None = None) -> tuple[list[str], list[str], str]:
    """Raw sources and references of a data config's test split, and its length unit. A config read
    from the file ``source`` (a checkpoint's) is checked and built by ``nmt.checkpoints.file_config``."""
    datamodule = load_data(data_cfg, source)
    sources, refs = datamodule.raw("test")
    return sources, refs, datamodule.src_words


def training_counts(datamodule: Any, chunk: int = 50_000) -> Counter[str]:
    """Word counts of the target side of the pairs the data config trains on (read in chunks)."""
    from nmt.data.prepare import TextColumn

    column, index = TextColumn(datamodule.prepared_dir, "train.tgt"), datamodule.datasets["train"].index
    total: Counter[str] = Counter()
    for start in range(0, len(index), chunk):
        total.update(word_frequency.counts(column.take(index[start : start + chunk])))
    return total


def translate_with_entropy(translator: Any, sources: list[str], attention: bool) -> tuple[list[str], list[float | None]]:
    """Each source's translation and, with ``attention``, the entropy of its attention
    (``nmt.evaluation.reordering.sentence_entropy``; None without attention), a batch's weights dropped
    once read, so memory does not grow with the test set."""
    texts, entropy = [""] * len(sources), [None] * len(sources)
    for batch in translator.batches(sources, attention=attention):
        for i, translation in batch:
            texts[i] = translation.text
            if translation.attention is not None:
                entropy[i] = reordering.sentence_entropy(translation.attention.weights)
    return texts, entropy


def reference_alignments(datamodule: Any, translators: dict[str, Any], sources: list[str], refs: list[str],
                         inputs: dict[str, list[str]]) -> tuple[str, list[set[tuple[int, int]]]] | None:
    """Word alignments of the test pairs and where they come from: the synthetic generator's gold
    ones, else the forced alignment of the references by the first checkpoint with attention,
    reading the sources as it translates them (``inputs``: with a multilingual model's tags);
    None when there is neither."""
    from nmt.inference.alignments import parse
    from nmt.data.sources import SyntheticSource
    from nmt.data.synthetic import gold_alignment

    if isinstance(datamodule.source, SyntheticSource):
        return "gold", [parse(gold_alignment(s)) for s in sources]
    for name, translator in translators.items():
        if translator.has_attention:
            links = []
            for start in range(0, len(sources), 256):
                part = slice(start, start + 256)
                src_ids = encode_sources(inputs[name][part], translator.src_vocab, translator.max_src_len)
                tgt_ids = [t[:-1] for t in encode_sources(refs[part], translator.tgt_vocab, translator.max_tgt_len)]
                links += [parse(a) for a in translator.alignments(src_ids, tgt_ids)]
            return f"{name}'s forced", links
    return None


def load_data(data_cfg: DictConfig | dict, source: str | None = None) -> Any:
    """The data module of a data config, set up for testing (see ``load_test_split``)."""
    if source is None:
        from nmt.training.builders import build_datamodule  # Lightning's import: only where a data config is built

        datamodule = build_datamodule(data_cfg)
    else:
        try:
            checked = file_config.check(data_cfg, "data", source)
            datamodule = file_config.build_data(checked, source, vocab_loader=saved_vocabularies)
        except file_config.ConfigRefused as e:
            raise CheckpointError(str(e)) from None
    datamodule.setup("test")
    return datamodule


SPLITS = ("test", "valid")  # what evaluate may translate and score
SIGNIFICANCE_COLUMNS = ["vs_baseline", "differing", "delta_bleu", "delta_ci_low", "delta_ci_high", "p_bootstrap",
                        "p_randomization"]


def compare(reports: dict[str, dict[str, Any]], out_dir: Path, title: str = "") -> dict[str, Path]:
    """Write the comparison of several systems: JSON, CSV (a row per system and bucket), markdown, PNG.

    A report with a ``significance`` entry (``nmt.evaluation.significance.significance``) fills the CSV's
    columns ``SIGNIFICANCE_COLUMNS`` (blank for the baseline) and adds its table to the markdown.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"comparison.{ext}" for ext in ("json", "csv", "md", "png")}
    paths["json"].write_text(json_text(reports))
    with paths["csv"].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["system", "bucket", "count", "bleu", "chrf", "bleu_ci_low", "bleu_ci_high", "length_ratio",
                         *SIGNIFICANCE_COLUMNS])
        for name, report in reports.items():
            sig = report.get("significance")
            tests = [[sig["baseline"], *(r[k] for k in ("differing", "delta", "delta_ci_low", "delta_ci_high",
                                                           "p_bootstrap", "p_randomization"))]
                     for r in sig["rows"]] if sig else [[None] * len(SIGNIFICANCE_COLUMNS)] * (len(report["buckets"]) + 1)
            for b, test in zip(report["buckets"], tests):
                writer.writerow([name, b["label"], b["count"], b["bleu"], b["chrf"], b["bleu_ci_low"], b["bleu_ci_high"],
                                 b.get("length_ratio"), *test])
            writer.writerow([name, "all", report["count"], report["bleu"], report["chrf"], *report["bleu_ci"],
                             report.get("length_ratio"), *tests[-1]])
    table, frequency = significance_table(reports), word_frequency.markdown(reports)
    source = next((r["reordering_alignments"] for r in reports.values() if r.get("reordering_alignments")), "")
    beyond = reordering.markdown(reports, source)
    tested = significance_table(reports, "reordering_vs_baseline")
    beyond += ("\nBy reordering distance: " + tested) if tested else ""
    paths["md"].write_text(markdown_table(reports) + ("\n" + table if table else "")
                           + ("\nWord F-measure by the word's count on the training target side:\n\n" + frequency
                              if frequency else "") + ("\n" + beyond if beyond else ""))
    plot_bleu_by_length(reports, paths["png"], title=title)
    return paths


def main() -> None:
    """``nmt-evaluate``, ``python evaluate.py``: the config resolvers, then Hydra composes and runs ``run``."""
    register_resolvers()
    run()


@hydra.main(config_path=CONF_DIR, config_name="evaluate", version_base="1.3")
@ending_cleanly()  # a user's error: one line on stderr, status 1
def run(cfg: DictConfig) -> None:
    evaluate(cfg)


def evaluate(cfg: DictConfig) -> None:
    """Translate the test split with each of ``cfg.ckpts``, read ``cfg.hyps``, and write each
    system's BLEU-by-length report and the comparison of all (with significance) to ``paths.output_dir``."""
    out_dir = Path(cfg.paths.output_dir)
    logging.getLogger("sacrebleu").setLevel(logging.WARNING)  # PairedTest logs each step of each bucket at INFO
    named = cfg.ckpts if isinstance(cfg.ckpts, DictConfig) else {}  # {name: file}, else names from the paths
    ckpts = [Path(p) for p in (named.values() if named else cfg.ckpts or [])]
    names = [str(n) for n in named] if named else [system_name(p) for p in ckpts]
    if len(set(names)) < len(names):
        raise ValueError(f"ckpts: several checkpoints would be named {sorted({n for n in names if names.count(n) > 1})}; "
                         "name them: ckpts={name: file, ...}")
    hyp_files = dict(cfg.hyps or {})
    if not ckpts and not hyp_files:
        raise ValueError("nothing to evaluate: set ckpts=[<file>.ckpt, ...] and/or hyps={name: file, ...}")
    split_name = str(cfg.get("split", "test"))
    if split_name not in SPLITS:
        raise ValueError(f"split={split_name}: choose one of {', '.join(SPLITS)} (tune on valid, read test once)")
    variants = [str(v) for v in cfg.get("test_variants") or []]
    if variants:
        from nmt.data.augment import modifiers

        modifiers([{"name": v, "rate": 1.0} for v in variants], key="test_variants")  # a bad name: before any work
        if not ckpts:
            raise ValueError("test_variants: the augmented copies are translated by the checkpoints of ckpts=[...]; "
                             "hypothesis files (hyps=) are of the clean test set")
    data_cfg, data_source = cfg.get("data"), None
    decoding = OmegaConf.to_container(cfg.decoding)
    loaded = [Translator.load(p, device=str(cfg.device), kernels=str(cfg.get("kernels", "auto")),
                              precision=str(cfg.get("precision", "auto")),
                              allow_pickle=cfg.allow_pickle, decoding=decoding, max_tokens=cfg.max_tokens) for p in ckpts]
    if data_cfg is None:
        if not loaded:
            raise ValueError("hypothesis files need a test split: set data=<name> (e.g. data=europarl_it_en)")
        data_cfg, data_source = loaded[0].run_config.get("data"), str(ckpts[0])
        if isinstance(data_cfg, dict):  # prepared data goes to this machine's cache, not the one the file names
            data_cfg = {**data_cfg, "cache_dir": str(cfg.paths.cache_dir)}
    datamodule = load_data(data_cfg, data_source)
    (tagged, refs), unit = datamodule.raw(split_name), datamodule.src_words
    sources = directions.untagged(tagged)  # what the reports count and show; multilingual models read the tags
    inputs = {name: directions.model_inputs(t, name, tagged, sources, datamodule) for name, t in zip(names, loaded)}
    split = directions.plan(datamodule)  # before any translation: the language identifier
    frequency = training_counts(datamodule) if cfg.get("word_frequency", True) else None
    hyps: dict[str, list[str]] = {}
    entropies: dict[str, list[float | None]] = {}
    for name, translator in zip(names, loaded):
        texts, entropy = translate_with_entropy(translator, inputs[name], bool(cfg.get("reordering", True)))
        hyps[name] = texts
        if any(e is not None for e in entropy):
            entropies[name] = entropy
        (out_dir / f"{name}.hyp.txt").write_text("".join(h + "\n" for h in hyps[name]), encoding="utf-8")
    for name, file in hyp_files.items():
        lines = read_lines(str(file), alternative=None)
        if len(lines) != len(refs):
            raise ValueError(f"{file}: {len(lines)} lines, but the {split_name} split has {len(refs)} references")
        hyps[str(name)] = lines
    baseline = str(cfg.baseline) if cfg.get("baseline") is not None else next(iter(hyps))
    test = Scored(sources, tagged, refs, unit, hyps, baseline)
    reports = {name: length_report(sources, h, refs, cfg.length_buckets, unit=unit, tokenize=cfg.sacrebleu_tokenize,
                                   n_bootstrap=cfg.n_bootstrap) for name, h in hyps.items()}
    if frequency is not None:
        by_frequency(cfg, test, frequency, reports)
    if cfg.get("reordering", True):
        by_reordering(cfg, test, reference_alignments(datamodule, dict(zip(names, loaded)), sources, refs, inputs), reports)
    for name, values in entropies.items():
        reports[name]["attention_entropy"] = reordering.entropy_by_length(sources, values, cfg.length_buckets, unit)
    if len(hyps) > 1:
        for name, result in significance(hyps, sources, refs, baseline, cfg.length_buckets, unit=unit,
                                         tokenize=cfg.sacrebleu_tokenize, **cfg.significance).items():
            reports[name]["significance"] = result
    for name, report in reports.items():
        write_report(report, out_dir / name, name=name)
    if split is not None:
        directions.write_direction_reports(split, tagged, hyps, refs, out_dir, reports, per_direction=True,
                                           edges=cfg.length_buckets, unit=unit, tokenize=cfg.sacrebleu_tokenize,
                                           n_bootstrap=cfg.n_bootstrap)
    paths = compare(reports, out_dir, title=cfg.get("title") or "")
    log.info("comparison -> %s\n%s", paths["md"], paths["md"].read_text())
    if variants:
        robust = robustness(cfg, dict(zip(names, loaded)), variants, (sources, refs, unit, inputs), reports, out_dir)
        log.info("clean and augmented test sets -> %s\n%s", robust, robust.read_text())


@dataclass
class Scored:
    """What every analysis reads: the split's sources (untagged and as stored), references and
    length unit, each system's hypotheses, and the system the others are tested against."""

    sources: list[str]
    tagged: list[str]
    refs: list[str]
    unit: str
    hyps: dict[str, list[str]]
    baseline: str


def by_frequency(cfg: DictConfig, test: Scored, frequency: Counter[str], reports: dict[str, dict[str, Any]]) -> None:
    """Word F-measure by training frequency per system (``frequency``), and paired against the
    baseline (``nmt.evaluation.word_frequency``)."""
    for name, h in test.hyps.items():
        reports[name]["frequency"] = word_frequency.bands(h, test.refs, frequency, n_bootstrap=cfg.n_bootstrap)
    for name in test.hyps:
        if len(test.hyps) > 1 and name != test.baseline:
            reports[name]["frequency_vs_baseline"] = {"baseline": test.baseline, "rows": word_frequency.paired(
                test.hyps[name], test.hyps[test.baseline], test.refs, frequency,
                n_bootstrap=int(cfg.significance.bootstrap))}


def by_reordering(cfg: DictConfig, test: Scored, aligned: tuple[str, list[Any]] | None,
                  reports: dict[str, dict[str, Any]]) -> None:
    """BLEU by reordering distance per system, from the reference alignments ``aligned`` (their
    origin, the links; None: no alignments, no analysis), with paired tests per distance bucket."""
    if aligned is None:
        return
    distances = [reordering.reordering_distance(links, len(s.split()), len(r.split()))
                 for links, s, r in zip(aligned[1], test.sources, test.refs)]
    for name, h in test.hyps.items():
        reports[name]["reordering"] = reordering.bleu_by_reordering(h, test.refs, distances,
                                                                    tokenize=cfg.sacrebleu_tokenize,
                                                                    n_bootstrap=cfg.n_bootstrap)
        reports[name]["reordering_alignments"] = aligned[0]
    if len(test.hyps) > 1:
        buckets = list(zip(reordering.reordering_labels(), reordering.reordering_buckets(distances)))
        tests = significance(test.hyps, test.sources, test.refs, test.baseline, cfg.length_buckets, unit=test.unit,
                             tokenize=cfg.sacrebleu_tokenize, buckets=buckets, **cfg.significance)
        for name, result in tests.items():
            reports[name]["reordering_vs_baseline"] = result


def robustness(cfg: DictConfig, translators: dict[str, Any], variants: list[str],
               test: tuple[list[str], list[str], str, dict[str, list[str]]], reports: dict[str, dict[str, Any]],
               out_dir: Path) -> Path:
    """Each checkpoint on augmented copies of the test set (``nmt.data.augment.augmented_copy``:
    ``upper`` in capitals, both sides; ``noise``: typing errors in the sources): a report per
    system and copy (``<name>.<variant>/``) and ``robustness.{json,md}``, BLEU beside the clean set's.
    ``test``: (sources, references, length unit, each system's sources as it reads them: with its language tags)."""
    from nmt.data.augment import augmented_copy

    sources, refs, unit, inputs = test
    langs = {name: [split_tag(read)[0] for read in inputs[name]] for name in translators}  # each pair's tag, if any
    table = {name: {"clean": {"bleu": reports[name]["bleu"], "bleu_ci": reports[name]["bleu_ci"],
                              "chrf": reports[name]["chrf"]}} for name in translators}
    for variant in variants:
        copy_sources, copy_refs = augmented_copy(variant, sources, refs, seed=int(cfg.seed))
        for name, translator in translators.items():
            hyps = [t.text for t in translator.translate([s if lang is None else f"{tag(lang)} {s}"
                                                          for lang, s in zip(langs[name], copy_sources)])]
            (out_dir / f"{name}.{variant}.hyp.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
            report = length_report(copy_sources, hyps, copy_refs, cfg.length_buckets, unit=unit,
                                   tokenize=cfg.sacrebleu_tokenize, n_bootstrap=cfg.n_bootstrap)
            write_report(report, out_dir / f"{name}.{variant}", name=f"{name} ({variant})")
            table[name][variant] = {k: report[k] for k in ("bleu", "bleu_ci", "chrf")}
    (out_dir / "robustness.json").write_text(json_text(table))
    columns = ["clean", *variants]
    lines = ["| system | " + " | ".join(f"{c} BLEU [95% CI]" for c in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for name, row in table.items():
        cells = [f"{row[c]['bleu']:.1f} [{row[c]['bleu_ci'][0]:.1f}, {row[c]['bleu_ci'][1]:.1f}]" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    path = out_dir / "robustness.md"
    path.write_text("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    main()

"""Score checkpoints or hypothesis files on a test split, overall and by source length.

    python evaluate.py ckpts=[runA/checkpoints/last.ckpt,runB/checkpoints/last.ckpt]
    python evaluate.py 'ckpts={final: run/checkpoints/last.ckpt, averaged: run/checkpoints/average_last5.ckpt}'
    python evaluate.py data=europarl_it_en 'hyps={lstm: lstm.txt, transformer: tf.txt}' baseline=lstm
    python evaluate.py 'ckpts={a: a.ckpt, b: b.ckpt, ensemble: [a.ckpt, b.ckpt]}'    # an ensemble is a list

With several systems: one comparison table (markdown, CSV, JSON) and one plot with a curve per
system, all scored on the same sentences per bucket, and every system tested against the baseline
(``baseline=``, default the first) with sacreBLEU's paired bootstrap and approximate randomisation,
overall and per bucket (``nmt/evaluation/significance.py``); with ``comet.model=<folder>``, COMET
beside BLEU and chrF (``nmt/evaluation/comet.py``). Without ``data=``, the test split is the one the
first checkpoint was trained on. The analyses themselves live in ``nmt.evaluation``; this module
loads the systems and the split, and runs them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from nmt.checkpoints import file_config
from nmt.checkpoints.files import CheckpointError, saved_vocabularies
from nmt.cli_io import hydra_command, stop_within_grace
from nmt.evaluation import directions, reordering
from nmt.evaluation.analyses import (Scored, by_comet, by_frequency, by_heads, by_reordering, check_head_options,
                                     reference_alignments, robustness, training_counts, translate_with_entropy, words_of)
from nmt.evaluation.comparison import compare
from nmt.evaluation.length_report import data_unit, length_buckets, length_report, write_report
from nmt.evaluation.significance import significance
from nmt.inference.translator import Translator
from nmt.runs.files import system_name
from nmt.text_lines import read_lines

log = logging.getLogger(__name__)


def load_test_split(data_cfg: DictConfig | dict, source: str | None = None) -> tuple[list[str], list[str], Any]:
    """Raw sources and references of a data config's test split, and its length unit. A config read
    from the file ``source`` (a checkpoint's) is checked and built by ``nmt.checkpoints.file_config``."""
    datamodule = load_data(data_cfg, source)
    sources, refs = datamodule.raw("test")
    return sources, refs, data_unit(datamodule)


def load_data(data_cfg: DictConfig | dict, source: str | None = None, split: str = "test",
              train_text: bool = False) -> Any:
    """The data module of a data config, set up for testing (see ``load_test_split``); a config read
    from the checkpoint ``source`` tokenizes with that checkpoint's own tokenizers and prepares
    ``split`` alone (with ``train_text``, the training text too, not encoded)."""
    if source is None:
        from nmt.training.builders import build_datamodule  # Lightning's import: only where a data config is built

        datamodule = build_datamodule(data_cfg)
    else:
        try:
            # the checkpoint's own tokenizers: none is trained, and the file's tokenizer options are not read
            checked = {**file_config.check(data_cfg, "data", source), "vocab_from": str(source)}
            datamodule = file_config.build_data(checked, source, vocab_loader=saved_vocabularies, splits=[split],
                                              train_text=train_text)
        except file_config.ConfigRefused as e:
            raise CheckpointError(str(e)) from None
    datamodule.setup("test")
    return datamodule


def system_files(entry: Any) -> list[str]:
    """The files of one system of ``ckpts``: a checkpoint or release file, or a list of them (an
    ensemble, ``nmt.models.ensemble``)."""
    files = list(entry) if isinstance(entry, (ListConfig, list, tuple)) else [entry]
    if not files or not all(isinstance(f, str) for f in files):
        raise ValueError(f"ckpts: {entry!r} is not a checkpoint file or a list of them (an ensemble)")
    return [str(f) for f in files]


SPLITS = ("test", "valid")  # what evaluate may translate and score
MAX_RESAMPLES = 100_000


def resamples(value: object, key: str) -> int:
    """A number of bootstrap resamples (0: off), or a one-line ValueError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RESAMPLES:
        raise ValueError(f"{key}={value!r}: a number of bootstrap resamples from 0 (off) to {MAX_RESAMPLES:,}")
    return value


def load_comet_model(cfg: DictConfig) -> Any:
    """The COMET model of ``cfg.comet`` (``nmt.evaluation.comet_files.load_comet``), or None when
    ``comet.model`` is null."""
    settings = cfg.get("comet") or {}
    if settings.get("model") is None:
        return None
    from nmt.machine import decoding_device
    from nmt.evaluation.comet_files import load_comet  # transformers: only where COMET is asked for

    return load_comet(str(settings.model), settings.get("encoder"), batch_size=settings.get("batch_size", 16),
                      device=decoding_device(str(settings.get("device", "auto")), "32"))


def request_languages(cfg: DictConfig, translators: dict[str, Any], sources: list[str],
                      datamodule: Any) -> dict[str, directions.Asked]:
    """How each system is asked for its translations (``nmt.evaluation.directions.request_languages``):
    a model that reads both languages with ``cfg``'s ``src_lang`` and ``tgt_lang``, or on a split of
    several directions each direction with its own; the others with none. A one-line ValueError where
    they are given and no system reads them."""
    src_lang, tgt_lang = cfg.get("src_lang"), cfg.get("tgt_lang")
    given = [f"{key}={value}" for key, value in (("src_lang", src_lang), ("tgt_lang", tgt_lang)) if value is not None]
    if given and not any(t.decoder_languages for t in translators.values()):
        raise ValueError(f"{', '.join(given)}: read only by a model that writes the target language as its first "
                         "output token (an imported M2M100, NLLB-200 or mBART-50); these systems take the test "
                         "split's languages: leave src_lang and tgt_lang unset")
    return {name: directions.request_languages(t, name, sources, datamodule, src_lang, tgt_lang)
            for name, t in translators.items()}


def evaluate(cfg: DictConfig) -> None:
    """Translate the test split with each of ``cfg.ckpts``, read ``cfg.hyps``, and write each
    system's BLEU-by-length report and the comparison of all (with significance) to ``paths.output_dir``."""
    out_dir = Path(cfg.paths.output_dir)
    logging.getLogger("sacrebleu").setLevel(logging.WARNING)  # PairedTest logs each step of each bucket at INFO
    named = cfg.ckpts if isinstance(cfg.ckpts, DictConfig) else {}  # {name: file}, else names from the paths
    ckpts = [system_files(entry) for entry in (named.values() if named else cfg.ckpts or [])]
    names = [str(n) for n in named] if named else ["+".join(system_name(Path(p)) for p in c) for c in ckpts]
    if len(set(names)) < len(names):
        raise ValueError(f"ckpts: several checkpoints would be named {sorted({n for n in names if names.count(n) > 1})}; "
                         "name them: ckpts={name: file, ...}")
    hyp_files = dict(cfg.hyps or {})
    if not ckpts and not hyp_files:
        raise ValueError("nothing to evaluate: set ckpts=[<file>.ckpt, ...] and/or hyps={name: file, ...}")
    for key in ("n_bootstrap", "significance.bootstrap"):
        resamples(OmegaConf.select(cfg, key), key)
    if cfg.get("heads", False):
        check_head_options(cfg.head_analysis)
    with stop_within_grace():  # the models' loads: a signal stops them within the grace, before any output
        comet = load_comet_model(cfg)  # before any translation: a folder it cannot read is one line now
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
    with stop_within_grace():
        loaded = [Translator.load(c[0] if len(c) == 1 else c, device=str(cfg.device),
                                  kernels=str(cfg.get("kernels", "auto")), precision=str(cfg.get("precision", "auto")),
                                  allow_pickle=cfg.allow_pickle, decoding=decoding, max_tokens=cfg.max_tokens)
                  for c in ckpts]
    if data_cfg is None:
        if not loaded:
            raise ValueError("hypothesis files need a test split: set data=<name> (e.g. data=europarl_it_en)")
        data_cfg, data_source = loaded[0].run_config.get("data"), str(ckpts[0][0])
        if isinstance(data_cfg, dict):  # prepared data goes to this machine's cache, not the one the file names
            data_cfg = {**data_cfg, "cache_dir": str(cfg.paths.cache_dir)}
    word_frequency = bool(cfg.get("word_frequency", True))  # counts the training split's target words
    datamodule = load_data(data_cfg, data_source, split_name, train_text=word_frequency)
    tagged, refs = datamodule.raw(split_name)
    # the unit and tokenizer of the split's languages (auto: nmt.languages.writing); directions resolve their own
    options, by_direction = directions.report_options(datamodule, cfg.length_buckets, cfg.sacrebleu_tokenize)
    unit, tokenize, edges = options["unit"], options["tokenize"], length_buckets(cfg.length_buckets, options["unit"])
    sources = directions.untagged(tagged)  # what the reports count and show; multilingual models read the tags
    inputs = {name: directions.model_inputs(t, name, tagged, sources, datamodule) for name, t in zip(names, loaded)}
    languages = request_languages(cfg, dict(zip(names, loaded)), sources, datamodule)
    split = directions.plan(datamodule)  # before any translation: the language identifier
    frequency = training_counts(datamodule, tokenize) if word_frequency else None
    hyps: dict[str, list[str]] = {}
    entropies: dict[str, list[float | None]] = {}
    seconds: dict[str, float] = {}
    for name, translator in zip(names, loaded):
        start = time.perf_counter()
        texts, entropy = translate_with_entropy(translator, inputs[name], bool(cfg.get("reordering", True)),
                                                languages[name])
        seconds[name] = time.perf_counter() - start
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
    test = Scored(sources, tagged, refs, unit, hyps, baseline, edges, tokenize,
                  (words_of(datamodule.src_lang, sources), words_of(datamodule.tgt_lang, refs)))
    reports = {name: length_report(sources, h, refs, edges, unit=unit, tokenize=tokenize,
                                   n_bootstrap=cfg.n_bootstrap) for name, h in hyps.items()}
    for name, value in seconds.items():  # with the attention the analyses read, when asked for
        reports[name]["translation_seconds"] = round(value, 2)
    if frequency is not None:
        by_frequency(cfg, test, frequency, reports)
    if cfg.get("reordering", True):
        by_reordering(cfg, test, reference_alignments(datamodule, dict(zip(names, loaded)), sources, refs, inputs, test.words),
                      reports)
    for name, values in entropies.items():
        reports[name]["attention_entropy"] = reordering.entropy_by_length(sources, values, edges, unit)
    if comet is not None:
        by_comet(cfg, test, reports, comet)
    if cfg.get("heads", False):
        for name, path in by_heads(cfg, dict(zip(names, loaded)), test, inputs, datamodule, out_dir).items():
            log.info("%s: attention heads -> %s", name, path)
    if len(hyps) > 1:
        for name, result in significance(hyps, sources, refs, baseline, edges, unit=unit,
                                         tokenize=tokenize, **cfg.significance).items():
            reports[name]["significance"] = result
    for name, report in reports.items():
        write_report(report, out_dir / name, name=name)
    if split is not None:
        directions.write_direction_reports(split, tagged, hyps, refs, out_dir, reports, per_direction=True,
                                           **by_direction, n_bootstrap=cfg.n_bootstrap)
    paths = compare(reports, out_dir, title=cfg.get("title") or "")
    for name, report in reports.items():
        comet = "" if report.get("comet") is None else f", COMET {report['comet']:.4f}"
        log.info("%s: BLEU %.2f, chrF %.2f%s (%d sentences)", name, report["bleu"], report["chrf"], comet, report["count"])
    log.info("comparison -> %s\n%s", paths["md"], paths["md"].read_text())
    if variants:
        robust = robustness(cfg, dict(zip(names, loaded)), variants, test, inputs, reports, out_dir, languages)
        log.info("clean and augmented test sets -> %s\n%s", robust, robust.read_text())


main = hydra_command("evaluate", evaluate)  # nmt-evaluate, python evaluate.py: nmt/conf/evaluate.yaml

if __name__ == "__main__":
    main()

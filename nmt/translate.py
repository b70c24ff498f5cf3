"""Translate text with a trained checkpoint: ``python translate.py ckpt=<run>/checkpoints/last.ckpt
< in.txt > out.txt`` (or ``input=in.txt output=out.txt``; see ``nmt/conf/translate.yaml``).

A checkpoint carries its run's resolved config and SentencePiece models, so nothing else is
needed. The input is read in chunks of ``chunk_lines`` lines and each finished line is written
(and flushed) as soon as every line before it is, so memory does not grow with the input and an
interrupted run leaves every finished line on disk. The output is opened only once the options,
the input files and the checkpoint are checked, and never when it is one of the inputs
(``nmt.cli_io``); SIGINT and SIGTERM stop the run between whole lines (exit status 130, 143), a
closed stdout (``| head``) ends it quietly (141), a user's error is one line ``error: ...`` on
stderr (status 2). Exactly one output line (``nbest``: k lines) is written per input line: empty
input lines stay empty, over-long lines are truncated to the model's limit with a warning,
invalid UTF-8 is an error naming the line (or, with ``errors=replace``, replaced and reported).

Backends (``backend``): ``torch`` (``nmt.inference.translator``: a checkpoint or release file) and
``ctranslate2`` (``nmt.inference.ctranslate2``: a folder written by ``nmt-export
format=ctranslate2``; torch is never imported); ``auto`` picks by what ``ckpt`` is.

A multilingual model (``data=multi30k_multilingual``) takes the language to translate into as
``tgt_lang=fr``: its tag ``<2fr>`` starts every input line (``nmt.languages.tags``); without it, each
line must start with a tag of its own. A line without one, or a language the model has no tag
for, stops the run before any output (for an input file: it is read once more first).

Modes (``mode``): ``translate`` with the configured ``decoding`` (``beam``, ``greedy``, ``sample``;
``decoding.nbest=k`` writes k ranked hypotheses per line), and ``score``: the log-probability of
given translations under the model (quality estimation, data filtering, reranking), from
``target=<file>`` (one per input line) or input lines ``source<TAB>target``, teacher-forced.

Output formats (``format``): ``text`` (one translation per line; the default of one-best
translation), ``tsv`` (the default of n-best and score) and ``jsonl``. n-best rows are
``line <TAB> rank <TAB> score <TAB> logprob <TAB> text`` (line and rank from 1; ``score`` is what
beam search ranks by, ``logprob / ((5 + n) / 6) ** alpha`` with n the tokens including EOS;
``logprob`` the sum of the tokens' log-probabilities); as JSON lines the same keys. An empty
input line gets k rows with empty text and scores 0. Scores: ``logprob <TAB> mean <TAB> tokens``
(with ``score_tokens=true`` the per-token values after one more tab); JSON lines ``line``,
``logprob``, ``mean``, ``tokens`` (``token_logprobs``); an empty source gives an empty line. The
rows are written by ``nmt.inference.translations``.
"""

from __future__ import annotations

import sys

from nmt.cli_io import hold_stop_signals

if __name__ == "__main__" or sys.argv and sys.argv[0].rsplit("/", 1)[-1] == "nmt-translate":
    hold_stop_signals()  # the program (translate.py holds them itself): a signal during the imports below is kept

import logging
import signal
import time
from pathlib import Path
from typing import IO, Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from nmt.inference.backends import backend_of, model_files, open_translator, search_settings
from nmt.cli_io import STOP_GRACE, OutputFile, StopSignals, Stopped, check_paths, hydra_command, stop_if_held
from nmt.inference.requests import GUIDES, Naming, Request
from nmt.inference.line_streams import OrderedWriter, Progress, chunked, count_lines, read_pairs
from nmt.text_lines import iter_lines, read_lines, report_replaced
from nmt.inference.translations import Translation, output_format, score_row, translation_rows

log = logging.getLogger(__name__)

ERRORS = ("strict", "replace")


def read_guides(cfg: DictConfig) -> dict[str, list[Any]]:
    """The guide file given (``prefixes=<file>``: a prefix per input line; ``constraints=<file>``:
    tab-separated phrases per input line; an empty line meaning none) as ``Request`` keys, or ``{}``.
    Guides need the input as a file (a line per input line) and mode=translate."""
    given = {key: cfg[key] for key in GUIDES if cfg.get(key)}
    if not given:
        return {}
    where = " and ".join(f"{key}={file}" for key, file in given.items())
    if cfg.mode == "score":
        raise ValueError(f"{where}: prefixes and constraints steer mode=translate; mode=score scores the targets given")
    if not regular_file(cfg.input):
        raise ValueError(f"{where}: give the input as a file (input=<file>), a line per line of the guides")
    guides = {key: read_lines(file, cfg.errors) for key, file in given.items()}
    if "constraints" in guides:
        guides["constraints"] = [line.split("\t") if line.strip() else [] for line in guides["constraints"]]
    return guides


def regular_file(path: str | None) -> bool:
    """Whether the input is a file that can be read twice (not stdin, a named pipe or a device)."""
    return path is not None and Path(path).is_file()


def naming(cfg: DictConfig, first_line: int, count: int) -> Naming:
    """How translate.py names a request's parts: input lines by number, options as given."""
    return Naming(numbers=range(first_line, first_line + count), item="line",
                  **{key: f"{key}={cfg[key]}" for key in GUIDES if cfg.get(key)})


def check_request(cfg: DictConfig, translator: Any, guides: dict[str, list[Any]]) -> None:
    """The whole request checked by the translator (``prepare``) before any output: the target
    language, and for a multilingual model or with guides each line of an input file with its
    guides, read as a stream (from stdin each chunk is checked as it comes, before its lines are
    written)."""
    translator.prepare(Request([], cfg.get("tgt_lang"), src_lang=cfg.get("src_lang")))
    if not (translator.target_languages or guides) or not regular_file(cfg.input):
        return  # checked per chunk as the lines come: a stream (stdin, a named pipe) is read once
    if guides:  # a line per input line: said before the lines themselves are judged
        count = sum(1 for _ in iter_lines(cfg.input, cfg.errors, []))
        for key, values in guides.items():
            if len(values) != count:
                raise ValueError(f"{key}={cfg[key]}: {len(values)} lines, but input={cfg.input} has {count}")
    lines = (s for s, _ in read_pairs(cfg.input, cfg.get("target"), cfg.errors, [], [])) if cfg.mode == "score" \
        else iter_lines(cfg.input, cfg.errors, [])
    offset = 0
    for chunk in chunked(lines, int(cfg.chunk_lines)):
        part = {key: values[offset : offset + len(chunk)] for key, values in guides.items()}
        translator.prepare(Request(chunk, cfg.get("tgt_lang"), src_lang=cfg.get("src_lang"), **part),
                           naming(cfg, offset + 1, len(chunk)))
        offset += len(chunk)


def translate_stream(cfg: DictConfig, translator: Any, writer: OrderedWriter, attention_dir: Path | None,
                     guides: dict[str, list[Any]] | None = None, signals: StopSignals | None = None) -> int:
    """Translate the input chunk by chunk into ``writer``; returns the number of input lines.
    ``signals``: a stop while the input is awaited ends the run at once (``StopSignals.waiting``)."""
    nbest, aligned = translator.settings.nbest, translator.settings.alignments
    fmt = output_format(str(cfg.format), "translate", nbest)
    wanted = set(cfg.attention_lines)
    replaced: list[int] = []
    offset = 0
    lines = iter_lines(cfg.input, cfg.errors, replaced)
    for chunk in chunked(signals.waiting(lines) if signals else lines, int(cfg.chunk_lines)):
        for i, line in enumerate(chunk):
            if not line.strip():
                writer.put(offset + i, translation_rows(offset + i + 1, Translation(), fmt, nbest, aligned))
        writer.flush()
        attention = {i - offset for i in wanted if offset <= i < offset + len(chunk)}
        extra = {key: lines[offset : offset + len(chunk)] for key, lines in (guides or {}).items()}
        languages = {"src_lang": cfg.get("src_lang")} if cfg.get("src_lang") is not None else {}
        for batch in translator.batches(chunk, attention=attention, first_line=offset + 1, tgt_lang=cfg.get("tgt_lang"),
                                        **languages, **extra):
            for i, translation in batch:
                number = offset + i + 1
                writer.put(offset + i, translation_rows(number, translation, fmt, nbest, aligned))
                if translation.attention is not None and attention_dir is not None:
                    save_attention(translation, number, attention_dir)
            writer.flush()
        offset += len(chunk)
    report_replaced(cfg.input, replaced)
    return offset


def save_attention(translation: Translation, number: int, folder: Path) -> None:
    from nmt.evaluation.plots import plot_attention  # matplotlib loads only when heatmaps are asked for

    a = translation.attention
    path = heatmap_path(folder, number)
    plot_attention(a.weights, a.source, a.target, path, title=f"line {number}")
    log.info("attention of line %d -> %s", number, path)


def score_stream(cfg: DictConfig, translator: Any, writer: OrderedWriter, signals: StopSignals | None = None) -> int:
    """Score the pairs of ``cfg.input`` (and ``cfg.target``) chunk by chunk into ``writer``."""
    fmt = output_format(str(cfg.format), "score", 1)
    replaced: list[int] = []
    replaced_targets: list[int] = []
    offset = 0
    pairs = read_pairs(cfg.input, cfg.get("target"), cfg.errors, replaced, replaced_targets)
    for chunk in chunked(signals.waiting(pairs) if signals else pairs, int(cfg.chunk_lines)):
        request = Request([s for s, _ in chunk], cfg.get("tgt_lang"), src_lang=cfg.get("src_lang"))
        prepared = translator.prepare(request, naming(cfg, offset + 1, len(chunk)))
        sources, targets = prepared.sources, [t for _, t in chunk]
        lead = {"lead": prepared.lead} if prepared.lead else {}  # an imported M2M100's target-language code
        for i, src in enumerate(sources):
            if not src.strip():
                writer.put(offset + i, [score_row(offset + i + 1, None, fmt, cfg.score_tokens)])
        writer.flush()
        for batch in translator.score_batches(sources, targets, first_line=offset + 1, **lead):
            for i, values in batch:
                writer.put(offset + i, [score_row(offset + i + 1, values, fmt, cfg.score_tokens)])
            writer.flush()
        offset += len(chunk)
    report_replaced(cfg.input, replaced)
    report_replaced(cfg.get("target"), replaced_targets)
    return offset


def attention_folder(cfg: DictConfig) -> Path | None:
    """Where heatmaps go: ``attention_dir``, else ``<hydra.run.dir>/attention`` when the run
    folder was given, else a new ``<paths.log_dir>/translate/<time>/attention``."""
    if not cfg.attention_lines:
        return None
    if cfg.get("attention_dir"):
        return Path(cfg.attention_dir)
    run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path.cwd()
    if run_dir.resolve() != Path.cwd().resolve():
        return run_dir / "attention"
    return Path(cfg.paths.log_dir) / cfg.task_name / time.strftime("%Y-%m-%d_%H-%M-%S") / "attention"


def heatmap_path(folder: Path, number: int) -> Path:
    """Where the heatmap of input line ``number`` (from 1) goes."""
    return folder / f"line{number:05d}.png"


def check_heatmaps(cfg: DictConfig, folder: Path | None) -> None:
    """Refuse, before any output, to write a heatmap over a file already there."""
    if folder is None:
        return
    taken = [p for p in (heatmap_path(folder, int(i) + 1) for i in cfg.attention_lines) if p.exists()]
    if taken:
        raise ValueError(f"attention_dir={folder}: {taken[0].name} is already there ({len(taken)} of the heatmaps asked "
                         "for would overwrite files); give a new or empty folder")


def check_options(cfg: DictConfig) -> None:
    """A bad ``mode``, ``backend``, ``precision``, ``errors``, ``format`` or ``decoding`` raises
    here, before the output is opened."""
    if cfg.mode not in ("translate", "score"):
        raise ValueError(f"mode={cfg.mode}: choose translate or score")
    if str(cfg.precision) not in ("auto", "32", "bf16", "int8"):
        raise ValueError(f"precision={cfg.precision!r}: choose one of auto, 32, bf16, int8")
    if cfg.errors not in ERRORS:
        raise ValueError(f"errors={cfg.errors}: choose strict or replace")
    for key, what in (("chunk_lines", "input lines read at a time (0 read a whole stream into memory)"),
                      ("max_tokens", "source tokens a batch"), ("workers", "batches decoded at once, or null")):
        value = cfg.get(key)
        if key == "workers" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r}: a positive whole number of {what}")
    backend_of(cfg)
    nbest = search_settings(cfg).nbest if cfg.mode == "translate" else 1
    output_format(str(cfg.format), str(cfg.mode), nbest)


def translate_until_stopped(cfg: DictConfig) -> None:
    """``translate_file`` under the run's stop-signal handlers."""
    with StopSignals(grace=STOP_GRACE) as signals:
        translate_file(cfg, signals)


run = hydra_command("translate", translate_until_stopped)  # nmt/conf/translate.yaml


def main() -> None:
    """``nmt-translate``, ``python translate.py``: stop signals kept from the start, then ``run``."""
    hold_stop_signals()
    try:
        run()
    except KeyboardInterrupt:  # Ctrl-C while Hydra composes, before run's own handlers
        raise SystemExit(128 + signal.SIGINT) from None
    stop_if_held()  # a signal after the run's handlers were gone (its lines are all written)


def translate_file(cfg: DictConfig, signals: StopSignals) -> None:
    """Check the options, paths and model, then stream the lines into the output (``OutputFile``):
    an error leaves an existing output file as it was."""
    check_options(cfg)
    check_paths({"input": cfg.input, **({"target": cfg.get("target")} if cfg.mode == "score" else {}),
                 **({"prefixes": cfg.prefixes} if cfg.get("prefixes") else {}),
                 **({"constraints": cfg.constraints} if cfg.get("constraints") else {}), **model_files(cfg)}, cfg.output)
    guides = read_guides(cfg)
    signals.check()
    translator = open_translator(cfg)
    signals.check()  # a stop during the model's load
    check_request(cfg, translator, guides)
    attention_dir = attention_folder(cfg)
    check_heatmaps(cfg, attention_dir)
    signals.check()  # the last stop before the output is opened
    output = None if cfg.output is None else OutputFile(cfg.output)
    out: IO[str] = sys.stdout if output is None else output.stream
    signals.defer()  # from here on, a signal stops the run between whole lines
    show = cfg.progress == "auto" and cfg.input is not None and sys.stderr.isatty() or cfg.progress is True
    progress = Progress(count_lines(cfg.input) if show and regular_file(cfg.input) else None, bool(show))
    writer = OrderedWriter(out, progress.advance, signals.check)
    try:
        if cfg.mode == "score":
            lines = score_stream(cfg, translator, writer, signals)
        else:
            lines = translate_stream(cfg, translator, writer, attention_dir, guides, signals)
    except Stopped as stop:
        stop.note = f"; the first {writer.next} lines are written to {cfg.output or 'stdout'}"
        if output is not None:
            output.finish()
        raise
    except BaseException:
        if output is not None:
            output.end_on_error()  # an existing output stays as it was
        raise
    finally:
        progress.close()
        translator.release()  # the captured searches' memory (CUDA graphs), before the process's own end
    if output is not None:
        output.finish()
    what = "scored" if cfg.mode == "score" else f"translated with {OmegaConf.to_container(cfg.decoding)}"
    log.info("%s %d lines (%s backend)", what, lines, translator.backend)


if __name__ == "__main__":
    main()

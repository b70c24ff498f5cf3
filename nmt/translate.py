"""Translate text with a trained checkpoint: ``python translate.py ckpt=<run>/checkpoints/last.ckpt
< in.txt > out.txt`` (or ``input=in.txt output=out.txt``; see ``nmt/conf/translate.yaml``).

A checkpoint carries its run's resolved config and SentencePiece models, so nothing else is
needed. The input is read in chunks of ``chunk_lines`` lines and each finished line is written
(and flushed) as soon as every line before it is, so memory does not grow with the input and an
interrupted run leaves every finished line on disk. The output is opened only once the options,
the input files and the checkpoint are checked, and never when it is one of the inputs
(``nmt.cli_io``); SIGINT and SIGTERM stop the run between whole lines (exit status 130, 143), a
closed stdout (``| head``) ends it quietly (141), a user's error is one line ``error: ...`` on
stderr (status 1). Exactly one output line (``nbest``: k lines) is written per input line: empty
input lines stay empty, over-long lines are truncated to the model's limit with a warning,
invalid UTF-8 is an error naming the line (or, with ``errors=replace``, replaced and reported).

Modes (``mode``): ``translate`` with the configured ``decoding`` (``beam``, ``greedy``, ``sample``;
``decoding.nbest=k`` writes k ranked hypotheses per line), and ``score``: the log-probability of
given translations under the model (``nmt.scoring``).

Output formats (``format``): ``text`` (one translation per line; the default of one-best
translation), ``tsv`` (the default of n-best and score) and ``jsonl``. n-best rows are
``line <TAB> rank <TAB> score <TAB> logprob <TAB> text`` (line and rank from 1; ``score`` is what
beam search ranks by, ``logprob / ((5 + n) / 6) ** alpha`` with n the tokens including EOS;
``logprob`` the sum of the tokens' log-probabilities); as JSON lines the same keys. An empty
input line gets k rows with empty text and scores 0.
"""

from __future__ import annotations

import codecs
import copy
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from nmt import CONF_DIR, register_resolvers
from nmt.checkpoint import load_checkpoint
from nmt.cli_io import StopSignals, Stopped, check_paths, close_output, ending_cleanly, open_output
from nmt.data.batching import TokenBatchSampler
from nmt.data.tokenizer import EOS, PAD, Tokenizer
from nmt.decoding import Hypotheses, length_penalty
from nmt import kernels
from nmt.kernels.malloc import bound_onednn_cache, keep_freed_memory

log = logging.getLogger(__name__)


def iter_lines(path: str | None, errors: str = "strict", replaced: list[int] | None = None) -> Iterator[str]:
    """Lines of a file (stdin when ``path`` is None) without their newline (nor a UTF-8 byte-order
    mark at the start), read lazily; invalid UTF-8 raises with the line number, or is replaced
    (U+FFFD) when ``errors="replace"`` and its line number appended to ``replaced``."""
    stream = sys.stdin.buffer if path is None else open(path, "rb")
    name = "<stdin>" if path is None else path
    with stream:
        for number, raw in enumerate(stream, start=1):
            raw = raw.rstrip(b"\r\n")
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as err:
                if errors != "replace":
                    raise ValueError(
                        f"{name}, line {number}: invalid UTF-8 ({err.reason} at byte {err.start}); "
                        f"fix the file or run with errors=replace"
                    ) from None
                if replaced is not None:
                    replaced.append(number)
                yield raw.decode("utf-8", errors="replace")


def read_lines(path: str | None, errors: str = "strict") -> list[str]:
    """All lines of ``iter_lines``; replaced lines are reported in one warning."""
    replaced: list[int] = []
    lines = list(iter_lines(path, errors, replaced))
    report_replaced(path, replaced)
    return lines


def report_replaced(path: str | None, replaced: list[int]) -> None:
    if replaced:
        log.warning("%s: replaced invalid UTF-8 on %d line(s): %s", path or "<stdin>", len(replaced), replaced[:20])


def chunked(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def encode_sources(lines: list[str], src_vocab: Tokenizer, max_len: int,
                   numbers: list[int] | None = None) -> list[list[int]]:
    """Subword ids + EOS per line; lines longer than ``max_len`` tokens are truncated, and the
    warning names them by ``numbers`` (their 1-based input line numbers; default 1..n)."""
    encoded, truncated = [], []
    for i, ids in enumerate(src_vocab.encode_batch(lines)):
        if len(ids) > max_len - 1:
            truncated.append(numbers[i] if numbers else i + 1)
            ids = ids[: max_len - 1]
        encoded.append(ids + [EOS])
    if truncated:
        log.warning("truncated %d line(s) longer than %d tokens: %s", len(truncated), max_len - 1, truncated[:20])
    return encoded


def pad(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((len(seqs), max(map(len, seqs))), PAD, dtype=torch.long)
    for i, seq in enumerate(seqs):
        out[i, : len(seq)] = torch.tensor(seq)
    out = out.to(device)
    return out, out != PAD


PRECISIONS = ("32", "bf16", "int8")


def prepare_model(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The model to decode with: ``int8``, a copy whose linear layers multiply in int8."""
    if str(precision) not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)}")
    model.eval()
    return copy.deepcopy(model).quantize_int8() if str(precision) == "int8" else model


@contextmanager
def threads_restored() -> Iterator[None]:
    """torch's intra-op thread count of the calling thread, set again after the block: a
    ``torch.set_num_threads`` in any thread (a pool's workers) also sets, process-wide, the count
    that threads started later begin with."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_batches(batches: list[Any], work: Callable[[Any], Any], device: torch.device, precision: str,
                workers: int | None) -> Iterator[Any]:
    """``work(batch)`` for every batch, results in batch order, under no-grad and (``bf16``)
    autocast. On a CPU, ``workers`` batches run at once, each on one thread (default: as many as
    torch has threads): a decoding step is many small operations that one thread runs nearly as
    fast as two, so batches side by side use the cores better than threads inside each operation."""

    def run(batch: Any) -> Any:
        # Grad mode and autocast are per thread: set them in the thread that decodes.
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=str(precision) == "bf16"):
            return work(batch)

    workers = min(workers or torch.get_num_threads(), len(batches)) if device.type == "cpu" else 1
    if workers <= 1:
        yield from map(run, batches)
        return
    with threads_restored():  # each worker sets its own count to 1
        pool = ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,))
        try:
            yield from pool.map(run, batches)
        finally:
            pool.shutdown(cancel_futures=True)  # after an error, the batches not started are dropped


def decode_batches(model: torch.nn.Module, src_vocab: Tokenizer, lines: list[str], search: Callable[..., Hypotheses],
                   max_tokens: int = 2048, max_src_len: int = 256, attention_lines: Iterable[int] = (),
                   precision: str = "32", workers: int | None = None,
                   first_line: int = 1) -> Iterator[tuple[list[int], Hypotheses, list[list[int]]]]:
    """Decode the non-empty ``lines`` in length-sorted batches; yields, batch after batch, the
    0-based indices into ``lines``, the batch's hypotheses and its source ids. Attention is
    computed for batches holding one of the 0-based ``attention_lines``; ``first_line`` is the
    input line number of ``lines[0]`` (for warnings)."""
    device = next(model.parameters()).device
    wanted = set(attention_lines)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    encoded = encode_sources([lines[i] for i in todo], src_vocab, max_src_len, numbers=[first_line + i for i in todo])
    batches = list(TokenBatchSampler([len(e) for e in encoded], max_tokens=max_tokens, batch_size=None, shuffle=False, seed=0))

    def work(batch: list[int]):
        src, src_mask = pad([encoded[j] for j in batch], device)
        need_attn = any(todo[j] in wanted for j in batch)
        return [todo[j] for j in batch], search(model, src, src_mask, need_attn=need_attn), [encoded[j] for j in batch]

    yield from run_batches(batches, work, device, precision, workers)


@torch.no_grad()
def translate_lines(
    model: torch.nn.Module,
    src_vocab: Tokenizer,
    tgt_vocab: Tokenizer,
    lines: list[str],
    search: Callable[..., Any],
    max_tokens: int = 2048,
    max_src_len: int = 256,
    attention_lines: Iterable[int] = (),
    precision: str = "32",
    workers: int | None = None,
) -> tuple[list[str], dict[int, tuple[torch.Tensor, list[str], list[str]]]]:
    """Translate ``lines`` in length-sorted batches; returns one hypothesis per line (empty for
    an empty line) and, for the 0-based ``attention_lines``, (attention (T, S), source pieces,
    target pieces). ``precision="bf16"`` decodes under bf16 autocast (matmuls in bf16, scores
    and softmax in fp32); ``precision="int8"`` (CPU) with a copy of the model whose linear layers
    multiply in int8 (``nmt.kernels.int8``), the rest in fp32."""
    model = prepare_model(model, precision)
    outputs = [""] * len(lines)
    attentions: dict[int, tuple[torch.Tensor, list[str], list[str]]] = {}
    wanted = set(attention_lines)
    for rows, hyps, sources in decode_batches(model, src_vocab, lines, search, max_tokens, max_src_len, wanted,
                                              precision, workers):
        for r, i in enumerate(rows):
            outputs[i] = tgt_vocab.decode(hyps.tokens[r])
            if i in wanted and hyps.attn is not None:
                attentions[i] = (hyps.attn[r][:, : len(sources[r])], src_vocab.pieces(sources[r]),
                                 tgt_vocab.pieces(hyps.tokens[r] + [EOS]))
    return outputs, attentions


def model_max_src_len(run_config: dict[str, Any]) -> int:
    """The longest source the model accepts: the data config's limit, capped by a Transformer
    encoder's position table."""
    limit = tokens(run_config.get("data", {}).get("max_src_len", 256), "data.max_src_len")
    encoder_max = run_config.get("model", {}).get("encoder", {}).get("max_len")
    return min(limit, tokens(encoder_max, "model.encoder.max_len")) if encoder_max else limit


def tokens(value: Any, key: str) -> int:
    """A length limit read from a checkpoint's config, or a ValueError naming its key."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the checkpoint's {key}={str(value)[:40]} is not a number of tokens")
    return value


# --- writing ------------------------------------------------------------------------------------
def nbest_rows(number: int, ranked: list[tuple[list[int], float]], k: int, tgt_vocab: Tokenizer, alpha: float,
               fmt: str) -> list[str]:
    """The k output rows of input line ``number``: its hypotheses, then empty ones if fewer."""
    rows = []
    for rank in range(1, k + 1):
        tokens, score = ranked[rank - 1] if rank <= len(ranked) else ([], 0.0)
        logprob = score * float(length_penalty(torch.tensor(len(tokens) + 1), alpha)) if rank <= len(ranked) else 0.0
        text = tgt_vocab.decode(tokens)
        if fmt == "jsonl":
            rows.append(json.dumps({"line": number, "rank": rank, "score": round(score, 4),
                                    "logprob": round(logprob, 4), "text": text}, ensure_ascii=False))
        else:
            rows.append(f"{number}\t{rank}\t{score:.4f}\t{logprob:.4f}\t{text}")
    return rows


class OrderedWriter:
    """Writes each input line's output rows in input order, as soon as every earlier line's
    are written, flushing after each run of lines; counts lines for the progress bar, then calls
    ``after_flush`` (``StopSignals.check``)."""

    def __init__(self, stream: IO[str], on_lines: Callable[[int], None] = lambda n: None,
                 after_flush: Callable[[], None] = lambda: None) -> None:
        self.stream, self.on_lines, self.after_flush = stream, on_lines, after_flush
        self.pending: dict[int, list[str]] = {}
        self.next = 0  # the next 0-based input line to write

    def put(self, index: int, rows: list[str]) -> None:
        self.pending[index] = rows

    def flush(self) -> None:
        start = self.next
        try:
            while self.next in self.pending:
                self.stream.write("".join(row + "\n" for row in self.pending.pop(self.next)))
                self.next += 1
            if self.next > start:
                self.stream.flush()
        except OSError as e:  # a full disk, say: name the output (a closed pipe stays a BrokenPipeError)
            if isinstance(e, BrokenPipeError) or e.filename:
                raise
            raise OSError(e.errno, e.strerror, f"output={getattr(self.stream, 'name', '?')}") from None
        if self.next > start:
            self.on_lines(self.next - start)
        self.after_flush()  # a stop asked for by a signal happens here, between whole lines


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))


class Progress:
    """Lines/s and ETA on stderr (rich), for an input file of known length."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

            self.bar = Bar(TextColumn("translating"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[rate]} lines/s"), TimeRemainingColumn(),
                           console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task("lines", total=total, rate="-")
            self.start = time.perf_counter()
            self.done = 0
            self.bar.start()

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.done += n
            rate = self.done / max(time.perf_counter() - self.start, 1e-9)
            self.bar.update(self.task, advance=n, rate=f"{rate:,.0f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def output_format(cfg: DictConfig, nbest: int) -> str:
    fmt = str(cfg.format)
    if fmt == "auto":
        return "tsv" if cfg.mode == "score" or nbest > 1 else "text"
    allowed = ("tsv", "jsonl") if cfg.mode == "score" or nbest > 1 else ("text", "jsonl")
    if fmt not in allowed:
        raise ValueError(f"format={fmt}: choose auto or one of {', '.join(allowed)} for "
                         f"{'scoring' if cfg.mode == 'score' else 'n-best lists' if nbest > 1 else 'translations'}")
    return fmt


def translate_stream(cfg: DictConfig, loaded, writer: OrderedWriter, attention_dir: Path | None) -> int:
    """Translate the input chunk by chunk into ``writer``; returns the number of input lines."""
    search = instantiate(cfg.decoding)
    nbest = int(cfg.decoding.get("nbest", 1) or 1)
    fmt = output_format(cfg, nbest)
    alpha = float(cfg.decoding.get("alpha", 0.0) or 0.0)
    model = prepare_model(loaded.model, cfg.precision)
    src_vocab, tgt_vocab = loaded.src_vocab, loaded.tgt_vocab
    max_src_len = model_max_src_len(loaded.run_config)
    wanted = set(cfg.attention_lines)
    replaced: list[int] = []
    offset = 0
    for chunk in chunked(iter_lines(cfg.input, cfg.errors, replaced), int(cfg.chunk_lines)):
        for i, line in enumerate(chunk):
            if not line.strip():
                writer.put(offset + i, nbest_rows(offset + i + 1, [], nbest, tgt_vocab, alpha, fmt) if nbest > 1 else
                           [json.dumps({"line": offset + i + 1, "text": "", "score": 0.0}) if fmt == "jsonl" else ""])
        writer.flush()
        attention = {i - offset for i in wanted if offset <= i < offset + len(chunk)}
        for rows, hyps, sources in decode_batches(model, src_vocab, chunk, search, cfg.max_tokens, max_src_len,
                                                  attention, cfg.precision, cfg.workers, first_line=offset + 1):
            for r, i in enumerate(rows):
                number = offset + i + 1
                if nbest > 1:
                    writer.put(offset + i, nbest_rows(number, hyps.nbest[r], nbest, tgt_vocab, alpha, fmt))
                else:
                    text = tgt_vocab.decode(hyps.tokens[r])
                    writer.put(offset + i, [json.dumps({"line": number, "text": text, "score": round(float(hyps.scores[r]), 4)},
                                                       ensure_ascii=False) if fmt == "jsonl" else text])
                if i in attention and hyps.attn is not None and attention_dir is not None:
                    from nmt.plots import plot_attention  # matplotlib loads only when heatmaps are asked for

                    path = attention_dir / f"line{number:05d}.png"
                    plot_attention(hyps.attn[r][:, : len(sources[r])], src_vocab.pieces(sources[r]),
                                   tgt_vocab.pieces(hyps.tokens[r] + [EOS]), path, title=f"line {number}")
                    log.info("attention of line %d -> %s", number, path)
            writer.flush()
        offset += len(chunk)
    report_replaced(cfg.input, replaced)
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


def check_options(cfg: DictConfig) -> None:
    """A bad ``mode``, ``precision``, ``errors``, ``format`` or ``decoding`` raises here, before
    the output is opened."""
    if cfg.mode not in ("translate", "score"):
        raise ValueError(f"mode={cfg.mode}: choose translate or score")
    if str(cfg.precision) not in PRECISIONS:
        raise ValueError(f"precision={cfg.precision!r}: choose one of {', '.join(PRECISIONS)}")
    if cfg.errors not in ("strict", "replace"):
        raise ValueError(f"errors={cfg.errors}: choose strict or replace")
    nbest = int(cfg.decoding.get("nbest", 1) or 1) if cfg.mode == "translate" else 1
    output_format(cfg, nbest)
    if cfg.mode == "translate":
        instantiate(cfg.decoding)
        beam_size = cfg.decoding.get("beam_size")
        if beam_size is not None and not 1 <= nbest <= int(beam_size):
            raise ValueError(f"nbest={nbest}: must be between 1 and the beam size ({beam_size})")


def main() -> None:
    """``nmt-translate``, ``python translate.py``: the config resolvers, then Hydra composes and runs ``run``."""
    register_resolvers()
    try:
        run()
    except KeyboardInterrupt:  # Ctrl-C while Hydra composes, before run's own handlers
        raise SystemExit(128 + signal.SIGINT) from None


@hydra.main(config_path=CONF_DIR, config_name="translate", version_base="1.3")
def run(cfg: DictConfig) -> None:
    with ending_cleanly(), StopSignals() as signals:
        translate_file(cfg, signals)


def translate_file(cfg: DictConfig, signals: StopSignals) -> None:
    """Check the options, paths and checkpoint, then open the output and stream the lines into
    it: an error before the first line leaves an existing output file as it was."""
    check_options(cfg)
    check_paths({"input": cfg.input, **({"target": cfg.get("target")} if cfg.mode == "score" else {}), "ckpt": cfg.ckpt},
                cfg.output)
    gpu = torch.cuda.is_available() and str(cfg.precision) != "int8"  # int8 decodes on CPUs
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if gpu else "cpu"))
    bound_onednn_cache()
    if kernels.on_cpu(cfg.kernels, device.type):
        keep_freed_memory()
    loaded = load_checkpoint(cfg.ckpt, device=device, allow_pickle=cfg.allow_pickle)
    loaded.model.set_kernels(cfg.kernels)
    out: IO[str] = sys.stdout if cfg.output is None else open_output(cfg.output)
    signals.defer()  # from here on, a signal stops the run between whole lines
    show = cfg.progress == "auto" and cfg.input is not None and sys.stderr.isatty() or cfg.progress is True
    progress = Progress(count_lines(cfg.input) if show and cfg.input is not None else None, bool(show))
    writer = OrderedWriter(out, progress.advance, signals.check)
    try:
        if cfg.mode == "score":
            from nmt.scoring import score_stream

            lines = score_stream(cfg, loaded, writer, output_format(cfg, 1))
        else:
            lines = translate_stream(cfg, loaded, writer, attention_folder(cfg))
    except Stopped as stop:
        stop.note = f"; the first {writer.next} lines are written to {cfg.output or 'stdout'}"
        raise
    finally:
        progress.close()
        if out is not sys.stdout:
            close_output(out)
    what = "scored" if cfg.mode == "score" else f"translated with {OmegaConf.to_container(cfg.decoding)}"
    log.info("%s %d lines", what, lines)


if __name__ == "__main__":
    main()

"""Input lines in, output rows out, for ``translate`` and ``score``: pairs read in step from two
files or one TSV (each read by ``nmt.text_lines``), chunks of lines, and a writer that writes each
line's rows in input order as soon as every earlier line's are written. No torch here.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO

from nmt.text_lines import InputError, columns, iter_lines, name_of


def chunked(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


_END = object()


def read_pairs(source: str | None, target: str | None, errors: str, replaced: list[int],
               replaced_targets: list[int] | None = None) -> Iterator[tuple[str, str]]:
    """(source, target) per line: two files read in step (an error when one ends first), or one
    file of ``source<TAB>target`` lines when ``target`` is None."""
    if target is None:
        for number, line in enumerate(iter_lines(source, errors, replaced), start=1):
            cols = columns(line)
            if isinstance(cols, str):
                raise InputError(f"{name_of(source)}, line {number}: {cols}; or give the targets in their own "
                                 "file with target=<file>")
            yield cols[0], cols[1]
        return
    sources, targets = iter_lines(source, errors, replaced), iter_lines(target, errors, replaced_targets)
    for number, (src, tgt) in enumerate(itertools.zip_longest(sources, targets, fillvalue=_END), start=1):
        if src is _END or tgt is _END:
            short, long = (name_of(source), target) if src is _END else (target, name_of(source))
            raise InputError(f"{short} has {number - 1} lines but {long} has more: give one target per source line")
        yield src, tgt


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

"""Every text a user gives, read under one set of rules: corpora (``nmt.data.readers``), the
input of translate and score, score targets, references, prefixes and constraints. Each problem
is an ``InputError`` naming the file (``<stdin>``) and line, what is wrong and what to do.

- UTF-8. A UTF-8 byte-order mark at the start is skipped. Bytes that are not UTF-8 are an error
  that names the encoding the file looks like (UTF-16 or UTF-32 by a byte-order mark or by the
  zero bytes of ASCII text, else Windows-1252/Latin-1 when the bytes read as that) and the
  ``iconv`` command that converts it; with ``errors="replace"`` they become U+FFFD instead and
  the line numbers are reported. A NUL byte is an error either way (a text file holds none).
- Lines end in LF or CRLF. A file whose lines end in CR only (old Mac) is refused, and so is a CR
  anywhere else in a line (CR and LF endings mixed, or a stray CR in a sentence): Python's
  universal newlines would split such a line, and line-aligned files would shift by one.
- A path ending in ``.gz`` is read through gzip; ``None`` is standard input, read as it comes (a
  chunk of lines at a time, one line at a time by default), so does a named pipe.
- A TSV row (``columns``) is exactly two tab-separated columns: a tab inside a sentence would
  hide the rest of it.

No torch here.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import logging
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

HEAD = 1 << 16  # bytes read first to recognise CR-only line endings and UTF-16/UTF-32
ERRORS = ("strict", "replace")
REPLACE = "run with errors=replace"  # the commands' option for text that is not all UTF-8
MAX_LINE_BYTES = 1 << 20  # a sentence longer than this (1 MiB) is an error, or cut (translate input)
MAX_SKIPPED_BYTES = 64 << 20  # the rest of a cut line read past to its end; more, and the input is no text


class InputError(ValueError):
    """A text a user gave is malformed; the message names it, the line and what to fix (the
    commands print it as one line)."""


def name_of(path: str | Path | None) -> str:
    return "<stdin>" if path is None else str(path)


def convert_command(path: str | Path | None, encoding: str) -> str:
    """The command that writes ``path`` as UTF-8 next to it."""
    if path is None:
        return f"iconv -f {encoding} -t UTF-8"
    path = Path(path)
    if path.suffix == ".gz":
        return f"zcat {path} | iconv -f {encoding} -t UTF-8 | gzip > {path.with_suffix('')}.utf8.gz"
    return f"iconv -f {encoding} -t UTF-8 {path} > {path}.utf8"


def wide_encoding(head: bytes) -> tuple[str, str] | None:
    """(description, iconv name) when a file starting with ``head`` looks like UTF-16 or UTF-32: a
    byte-order mark, or the zero bytes that ASCII text has there."""
    for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                      (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if head.startswith(bom):
            return f"{name} (byte-order mark {bom.hex(' ').upper()})", name
    sample = head[: min(len(head), 4096) // 4 * 4]
    if len(sample) < 8:
        return None
    zero = [sample[i::4].count(0) / len(sample[i::4]) for i in range(4)]  # share of zero bytes per position mod 4
    for name, zeros, others in (("UTF-32LE", (1, 2, 3), (0,)), ("UTF-32BE", (0, 1, 2), (3,)),
                                ("UTF-16LE", (1, 3), (0, 2)), ("UTF-16BE", (0, 2), (1, 3))):
        if all(zero[k] > 0.5 for k in zeros) and all(zero[k] < 0.1 for k in others):
            return f"{name} (no byte-order mark; most of its ASCII bytes are followed by zero bytes)", name
    return None


class _Reader:
    """The lines of one file or stream, a block of whole lines at a time, under the module's rules."""

    def __init__(self, path: str | Path | None, errors: str, replaced: list[int] | None, error: type[InputError],
                 alternative: str | None = None) -> None:
        if errors not in ERRORS:
            raise ValueError(f"errors={errors!r}: choose one of {', '.join(ERRORS)}")
        self.path, self.name, self.errors, self.replaced, self.error = path, name_of(path), errors, replaced, error
        self.alternative = alternative  # what else the caller's user may do about bytes that are not UTF-8
        self.head = b""
        self.done = 0  # lines read so far
        self.utf8_before = False  # a non-ASCII UTF-8 line came before

    def fail(self, line: int, what: str) -> None:
        raise self.error(f"{self.name}, line {line}: {what}")

    def nul(self, line: int) -> None:
        """Raise the error for a NUL byte in ``line``."""
        wide = wide_encoding(self.head)
        what = (f"it looks like {wide[0]}; convert it: {convert_command(self.path, wide[1])}" if wide else
                "a text file holds none: is it binary, or in another encoding?")
        self.fail(line, f"a NUL byte (0x00); {what}")

    def check_head(self, head: bytes) -> None:
        self.head = head
        if b"\r" in head and b"\n" not in head:
            raise self.error(f"{self.name}, line 1: lines end in CR only (old Mac line endings), not LF; "
                             f"convert it: tr '\\r' '\\n' < {self.name} > {self.name}.lf")

    def _hint(self, line: bytes, utf8_before: bool) -> str:
        """What the bytes of a line that is not UTF-8 look like, and what to do."""
        wide = wide_encoding(self.head)
        if wide:
            return f"it looks like {wide[0]}; convert it: {convert_command(self.path, wide[1])}"
        try:
            line.decode("cp1252")
        except UnicodeDecodeError:
            where = "" if self.path is None else f" (file -i {self.path})"
            return f"find its encoding{where} and convert it: {convert_command(self.path, '<encoding>')}"
        if utf8_before:
            return ("the lines before it are UTF-8 with other non-ASCII characters, so the file mixes encodings "
                    "(this line reads as Windows-1252/Latin-1); fix the line")
        return f"it looks like Windows-1252/Latin-1; convert it: {convert_command(self.path, 'WINDOWS-1252')}"

    def _replace(self, raw: list[bytes]) -> str:
        """``errors="replace"``: each line decoded on its own, invalid bytes as U+FFFD, its number kept."""
        out = []
        for k, line in enumerate(raw):
            try:
                out.append(line.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(line.decode("utf-8", errors="replace"))
                if self.replaced is not None:
                    self.replaced.append(self.done + k + 1)
        return "".join(out)

    def decode(self, raw: list[bytes]) -> list[str]:
        """Whole lines (the first is line ``done`` + 1) as text without their LF or CRLF."""
        data = b"".join(raw)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            if self.errors == "replace":
                text = self._replace(raw)
            else:
                start = data.rfind(b"\n", 0, e.start) + 1
                end = data.find(b"\n", e.start)
                hint = self._hint(data[start : end if end >= 0 else len(data)],
                                  self.utf8_before or not data[:start].isascii())
                also = f"; or {self.alternative}" if self.alternative else ""
                self.fail(self.done + data.count(b"\n", 0, e.start) + 1,
                           f"invalid UTF-8 (byte 0x{data[e.start]:02x} at byte column {e.start - start + 1}); {hint}{also}")
        if "\0" in text:
            self.nul(self.done + text.count("\n", 0, text.index("\0")) + 1)
        self.utf8_before = self.utf8_before or not text.isascii()
        lines = (text.removeprefix("\ufeff") if self.done == 0 else text).split("\n")
        if lines[-1] == "":
            lines.pop()
        if "\r" in text:
            lines = [line[:-1] if line.endswith("\r") else line for line in lines]
            for k, line in enumerate(lines):
                if "\r" in line:
                    self.fail(self.done + k + 1, "a carriage return (CR) inside the line: CR and LF line endings are "
                               "mixed, or a sentence holds a stray CR; remove stray CRs (tr -d '\\r') or turn CR line "
                               "endings into LF (sed 's/\\r$//' | tr '\\r' '\\n')")
        self.done += len(raw)
        return lines


def _open(path: str | Path | None) -> BinaryIO:
    if path is None:
        return contextlib.nullcontext(sys.stdin.buffer)  # type: ignore[return-value]  # read, never closed
    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")  # type: ignore[return-value]


def _seekable(stream: BinaryIO) -> bool:
    try:
        return stream.seekable()
    except (OSError, ValueError):
        return False


def whole_characters(data: bytes) -> bytes:
    """UTF-8 ``data`` without a character cut off at its end."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the last character starts here
            size = 1 if byte < 0xC0 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if back >= size else data[:-back]
    return data


def _raw_lines(stream: BinaryIO, count: int, reader: _Reader, max_bytes: int, long_lines: str,
               cut: list[int] | None) -> list[bytes]:
    """Up to ``count`` lines of bytes; a line over ``max_bytes`` is never read whole: an error
    (``long_lines="error"``) or cut to its first ``max_bytes`` bytes (a whole character), the rest
    skipped and its line number appended to ``cut``."""
    raw = []
    while len(raw) < count and (line := stream.readline(max_bytes + 1)):
        if len(line) > max_bytes and not line.endswith(b"\n"):
            number = reader.done + len(raw) + 1
            if long_lines == "error":
                reader.fail(number, f"longer than {max_bytes:,} bytes; a sentence is one line (is the file line-aligned "
                                    "text?)")
            skipped = 0
            while rest := stream.readline(1 << 20):  # the rest of the line, a MiB at a time, to its end
                if b"\0" in line or b"\0" in rest:  # /dev/zero: a NUL is an error in any line, cut or not
                    reader.nul(number)
                skipped += len(rest)
                if rest.endswith(b"\n"):
                    break
                if skipped > MAX_SKIPPED_BYTES:
                    reader.fail(number, f"no line end in its first {MAX_SKIPPED_BYTES + max_bytes:,} bytes; a sentence "
                                        "is one line (is the input text?)")
            line = whole_characters(line[:max_bytes]) + b"\n"
            if cut is not None:
                cut.append(number)
        raw.append(line)
    return raw


def iter_blocks(path: str | Path | None, chunk: int = 1, strip: bool = False, errors: str = "strict",
                replaced: list[int] | None = None, error: type[InputError] = InputError,
                alternative: str | None = None, max_bytes: int | None = None, long_lines: str = "error",
                cut: list[int] | None = None) -> Iterator[list[str]]:
    """The lines of ``path`` (standard input when None) without their line ends, ``chunk`` at a
    time (the last block may be shorter), each stripped of surrounding whitespace when ``strip``;
    ``errors`` and the problems raised as ``error`` (an ``InputError`` class): the module's text.
    Line numbers whose invalid UTF-8 was replaced are appended to ``replaced``; ``alternative``
    ends the message about bytes that are not UTF-8 (``or <alternative>``). A line over
    ``max_bytes`` (default ``MAX_LINE_BYTES``) is an error, or with ``long_lines="cut"`` cut there
    (its number appended to ``cut``)."""
    max_bytes = MAX_LINE_BYTES if max_bytes is None else max_bytes
    reader = _Reader(path, errors, replaced, error, alternative)
    try:
        with _open(path) as stream:
            if _seekable(stream):  # a file: its head names CR-only endings and wide encodings up front
                reader.check_head(stream.read(HEAD))
                stream.seek(0)
            while raw := _raw_lines(stream, chunk, reader, max_bytes, long_lines, cut):
                if reader.done == 0 and not reader.head:
                    reader.check_head(raw[0][:HEAD])  # a stream: its first line (a CR-only file: all of it)
                lines = reader.decode(raw)
                yield [line.strip() for line in lines] if strip else lines
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise error(f"{reader.name}: not a complete gzip file ({e}); copy or compress it again") from None


def iter_lines(path: str | Path | None, errors: str = "strict", replaced: list[int] | None = None,
               strip: bool = False, alternative: str | None = REPLACE) -> Iterator[str]:
    """``iter_blocks`` a line at a time (standard input is read as each line comes), for text to
    translate: a line over ``MAX_LINE_BYTES`` is cut there, with a warning."""
    cut: list[int] = []
    for block in iter_blocks(path, 1, strip, errors, replaced, alternative=alternative, long_lines="cut", cut=cut):
        if cut:
            log.warning("%s, line %d: cut to its first %s bytes (the model reads far fewer tokens)", name_of(path),
                        cut.pop(), f"{MAX_LINE_BYTES:,}")
        yield from block


def read_lines(path: str | Path | None, errors: str = "strict", strip: bool = False,
               alternative: str | None = REPLACE) -> list[str]:
    """All lines of ``path`` (files in blocks); replaced lines are reported in one warning."""
    replaced: list[int] = []
    chunk = 1 if path is None else 10_000
    lines = [line for block in iter_blocks(path, chunk, strip, errors, replaced, alternative=alternative) for line in block]
    report_replaced(path, replaced)
    return lines


def report_replaced(path: str | Path | None, replaced: list[int]) -> None:
    if replaced:
        log.warning("%s: replaced invalid UTF-8 on %d line(s): %s", name_of(path), len(replaced), replaced[:20])


def columns(line: str) -> list[str] | str:
    """The two columns of a TSV row (``source<TAB>target``; a blank row is two empty ones), or what
    is wrong with it."""
    if not line.strip():
        return ["", ""]
    cols = line.split("\t")
    if len(cols) != 2:
        return f"expected 2 tab-separated columns (source<TAB>target), found {len(cols)}"
    return cols


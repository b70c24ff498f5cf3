"""Local corpus files, read line by line: two line-aligned text files, TSV (source TAB target) or
JSON lines, each plain or gzip-compressed (`.gz`). Nothing is dropped or changed silently: every
problem is a `DataError` naming the file and line, what is wrong and what to do.

- UTF-8 only. A UTF-8 byte-order mark at the start of a file is skipped. Bytes that are not
  UTF-8, and NUL bytes, are an error that names the encoding the file looks like (UTF-16 or
  UTF-32 by a byte-order mark or by the zero bytes of ASCII text, else Windows-1252/Latin-1 when
  the bytes read as that) and the `iconv` command that converts it.
- Lines end in LF or CRLF. A file whose lines end in CR only (old Mac) is refused, and so is a CR
  anywhere else in a line (CR and LF endings mixed, or a stray CR in a sentence): Python's
  universal newlines would split such a line, a line-aligned corpus would shift by one.
- Sentences are stripped of surrounding whitespace (`str.strip`); pairs with an empty side are
  dropped and counted downstream (`nmt.data.sources.drop_empty`).
- TSV: exactly two tab-separated columns a row (a tab inside a sentence would hide the rest of
  it); a blank row is an empty pair.
- JSONL: one object a row, with a string (no line break) under each language key, at the top or
  under "translation"; other keys (ids, scores, other languages) are ignored; a blank row is an
  empty pair.
- `bad_rows="skip"` (`data.source.bad_rows`) skips malformed TSV/JSONL rows instead, and logs how
  many and which.
"""

from __future__ import annotations

import codecs
import gzip
import itertools
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger(__name__)

CHUNK = 50_000  # sentence pairs a source yields at a time
HEAD = 1 << 16  # bytes read first to recognise CR-only line endings and UTF-16/UTF-32
BAD_ROWS = ("error", "skip")
Pairs = tuple[list[str], list[str]]  # (source sentences, target sentences) of one chunk


class DataError(ValueError):
    """A corpus cannot be loaded or is malformed; the message says what to fix (a user's error:
    the commands print it as one line)."""


def _open(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # type: ignore[return-value]


def _convert(path: Path, encoding: str) -> str:
    """The command that writes `path` as UTF-8 next to it."""
    if path.suffix == ".gz":
        return f"zcat {path} | iconv -f {encoding} -t UTF-8 | gzip > {path.with_suffix('')}.utf8.gz"
    return f"iconv -f {encoding} -t UTF-8 {path} > {path}.utf8"


def wide_encoding(head: bytes) -> tuple[str, str] | None:
    """(description, iconv name) when a file starting with `head` looks like UTF-16 or UTF-32: a
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


def _encoding_hint(path: Path, head: bytes, line: bytes, utf8_before: bool) -> str:
    """What the bytes look like and what to do, for a line of `path` that is not UTF-8."""
    wide = wide_encoding(head)
    if wide:
        return f"it looks like {wide[0]}; convert it: {_convert(path, wide[1])}"
    try:
        line.decode("cp1252")
    except UnicodeDecodeError:
        return f"find its encoding (file -i {path}) and convert it: {_convert(path, '<encoding>')}"
    if utf8_before:
        return ("the lines before it are UTF-8 with other non-ASCII characters, so the file mixes encodings "
                "(this line reads as Windows-1252/Latin-1); fix the line")
    return f"it looks like Windows-1252/Latin-1; convert it: {_convert(path, 'WINDOWS-1252')}"


def _check_head(path: Path, head: bytes) -> None:
    if b"\r" in head and b"\n" not in head:
        raise DataError(f"{path}, line 1: lines end in CR only (old Mac line endings), not LF; "
                        f"convert it: tr '\\r' '\\n' < {path} > {path}.lf")


def _decode(path: Path, data: bytes, done: int, head: bytes, utf8_before: bool) -> str:
    """`data` (whole lines, the first at line `done` + 1) as text, or a `DataError` at the first
    byte that is not UTF-8, or the first NUL."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        start = data.rfind(b"\n", 0, e.start) + 1
        end = data.find(b"\n", e.start)
        line = done + data.count(b"\n", 0, e.start) + 1
        hint = _encoding_hint(path, head, data[start : end if end >= 0 else len(data)],
                              utf8_before or not data[:start].isascii())
        raise DataError(f"{path}, line {line}: invalid UTF-8 (byte 0x{data[e.start]:02x} at byte column "
                        f"{e.start - start + 1}); {hint}") from None
    if "\0" in text:
        line = done + text.count("\n", 0, text.index("\0")) + 1
        wide = wide_encoding(head)
        what = (f"it looks like {wide[0]}; convert it: {_convert(path, wide[1])}" if wide else
                "a text file holds none: is it binary, or in another encoding?")
        raise DataError(f"{path}, line {line}: a NUL byte (0x00); {what}")
    return text


def _line_ends(path: Path, lines: list[str], done: int) -> list[str]:
    """`lines` without the CR of CRLF; any other CR is an error naming its line."""
    out = [line[:-1] if line.endswith("\r") else line for line in lines]
    for k, line in enumerate(out):
        if "\r" in line:
            raise DataError(f"{path}, line {done + k + 1}: a carriage return (CR) inside the line: CR and LF line "
                            "endings are mixed, or a sentence holds a stray CR; remove stray CRs (tr -d '\\r') or "
                            "turn CR line endings into LF (sed 's/\\r$//' | tr '\\r' '\\n')")
    return out


def iter_lines(path: Path, chunk: int = CHUNK, strip: bool = True) -> Iterator[list[str]]:
    """Lines of a UTF-8 text file (gzip-compressed when it ends in .gz) without their LF or CRLF,
    stripped unless `strip` is false, `chunk` at a time; see the module docstring for errors."""
    path = Path(path)
    try:
        yield from _iter_lines(path, chunk, strip)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: not a complete gzip file ({e}); copy or compress it again") from None


def _iter_lines(path: Path, chunk: int, strip: bool) -> Iterator[list[str]]:
    done, utf8_before = 0, False
    with _open(path) as f:
        head = f.read(HEAD)
        _check_head(path, head)
        f.seek(0)
        while raw := list(itertools.islice(f, chunk)):
            data = b"".join(raw)
            text = _decode(path, data, done, head, utf8_before)
            utf8_before = utf8_before or not text.isascii()
            lines = (text.removeprefix("\ufeff") if done == 0 else text).split("\n")
            if lines[-1] == "":
                lines.pop()
            if "\r" in text:
                lines = _line_ends(path, lines, done)
            done += len(raw)
            yield [line.strip() for line in lines] if strip else lines


def read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file, stripped; errors as `iter_lines`."""
    return [line for lines in iter_lines(Path(path)) for line in lines]


def iter_parallel(src_path: Path, tgt_path: Path, chunk: int = CHUNK) -> Iterator[Pairs]:
    """Two line-aligned files, `chunk` lines at a time; when one ends first, `DataError` names both
    files and their line counts."""
    src_chunks, tgt_chunks = iter_lines(src_path, chunk), iter_lines(tgt_path, chunk)
    done = 0
    for src in src_chunks:
        tgt = next(tgt_chunks, [])
        if len(src) != len(tgt):
            _misaligned(src_path, done + len(src) + sum(map(len, src_chunks)),
                        tgt_path, done + len(tgt) + sum(map(len, tgt_chunks)))
        done += len(src)
        yield src, tgt
    rest = sum(map(len, tgt_chunks))
    if rest:
        _misaligned(src_path, done, tgt_path, done + rest)


def _misaligned(src_path: Path, src_lines: int, tgt_path: Path, tgt_lines: int) -> None:
    raise DataError(f"misaligned parallel files: {src_path} has {src_lines} lines but "
                    f"{tgt_path} has {tgt_lines} lines; line i of one must translate line i "
                    "of the other")


class _BadRows:
    """Malformed rows of one file: an error at the first, or (``skip``) counted and logged."""

    def __init__(self, path: Path, policy: str) -> None:
        if policy not in BAD_ROWS:
            raise DataError(f"data.source.bad_rows={policy!r}: choose one of {', '.join(BAD_ROWS)}")
        self.path, self.policy = path, policy
        self.lines: list[int] = []
        self.first = ""

    def __call__(self, line: int, what: str) -> None:
        message = f"{self.path}, line {line}: {what}"
        if self.policy == "error":
            raise DataError(f"{message}; fix the row, or set data.source.bad_rows=skip to skip such rows")
        self.lines.append(line)
        self.first = self.first or message

    def report(self) -> None:
        if self.lines:
            log.warning("%s: skipped %d malformed row(s) (data.source.bad_rows=skip), lines %s; the first: %s",
                        self.path, len(self.lines), self.lines[:20], self.first)


def iter_tsv(path: Path, chunk: int = CHUNK, bad_rows: str = "error") -> Iterator[Pairs]:
    """A two-column (source TAB target) file, `chunk` lines at a time."""
    bad, i = _BadRows(path, bad_rows), 0
    for lines in iter_lines(path, chunk, strip=False):
        src, tgt = [], []
        for line in lines:
            i += 1
            cols = line.split("\t") if line.strip() else ["", ""]
            if len(cols) != 2:
                bad(i, f"expected 2 tab-separated columns (source<TAB>target), found {len(cols)}")
                continue
            src.append(cols[0].strip())
            tgt.append(cols[1].strip())
        yield src, tgt
    bad.report()


def _json_pair(line: str, src_lang: str, tgt_lang: str) -> tuple[str, str] | str:
    """The (source, target) of one JSONL row, or what is wrong with it."""
    try:
        obj = json.loads(line, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return "not JSON (nested too deeply)"
    except ValueError as e:  # an integer of thousands of digits, a key given twice
        return f"not JSON ({str(e).split(';')[0]})"
    if not isinstance(obj, dict):
        return f"expected a JSON object, found {_json_type(obj)}"
    pair = obj.get("translation", obj)
    if not isinstance(pair, dict):
        return f"'translation' holds {_json_type(pair)}, not an object"
    values = []
    for lang in (src_lang, tgt_lang):
        if lang not in pair:
            return (f"no key {lang!r} (keys: {', '.join(map(repr, pair)) or 'none'}); give {src_lang!r} and "
                    f"{tgt_lang!r}, at the top or under 'translation'")
        value = pair[lang]
        if not isinstance(value, str):
            return f"the {lang!r} value is {_json_type(value)}, not a string"
        value = value.strip()
        if "\n" in value or "\r" in value:
            return f"the {lang!r} value holds a line break; a sentence is one line (replace it with a space)"
        if not value.isascii() and any("\ud800" <= c <= "\udfff" for c in value):
            return f"the {lang!r} value holds a lone surrogate escape (such as \\ud800), which is not text"
        values.append(value)
    return values[0], values[1]


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (else one value would be dropped silently)."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        raise ValueError(f"the key {next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))!r} is given twice")
    return obj


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def iter_jsonl(path: Path, src_lang: str, tgt_lang: str, chunk: int = CHUNK,
               bad_rows: str = "error") -> Iterator[Pairs]:
    """One JSON object a line: {src_lang: .., tgt_lang: ..} or {"translation": {...}}."""
    bad, i = _BadRows(path, bad_rows), 0
    for lines in iter_lines(path, chunk):
        src, tgt = [], []
        for line in lines:
            i += 1
            pair = _json_pair(line, src_lang, tgt_lang) if line else ("", "")
            if isinstance(pair, str):
                bad(i, pair)
                continue
            src.append(pair[0])
            tgt.append(pair[1])
        yield src, tgt
    bad.report()

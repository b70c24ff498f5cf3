"""Local corpus files, read line by line: two line-aligned text files, TSV (source TAB target) or
JSON lines, each plain or gzip-compressed (`.gz`). Nothing is dropped or changed silently: every
problem is a `DataError` naming the file and line, what is wrong and what to do.

- Every file is read under the rules of `nmt.text_lines` (UTF-8, LF or CRLF line ends, no NUL
  bytes, gzip by `.gz`), its errors raised as `DataError`.
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

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nmt.text_lines import InputError, columns, iter_blocks

log = logging.getLogger(__name__)

CHUNK = 50_000  # sentence pairs a source yields at a time
BAD_ROWS = ("error", "skip")
Pairs = tuple[list[str], list[str]]  # (source sentences, target sentences) of one chunk


class DataError(InputError):
    """A corpus cannot be loaded or is malformed; the message says what to fix (a user's error:
    the commands print it as one line)."""


def iter_lines(path: Path, chunk: int = CHUNK, strip: bool = True) -> Iterator[list[str]]:
    """Lines of a text file without their LF or CRLF, stripped unless `strip` is false, `chunk` at
    a time, under the rules of `nmt.text_lines` (its errors as `DataError`)."""
    yield from iter_blocks(Path(path), chunk, strip, error=DataError)


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
            cols = columns(line)
            if isinstance(cols, str):
                bad(i, cols)
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

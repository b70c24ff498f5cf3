"""The corpus readers lose nothing silently: a row without exactly a source and a target, CR line
endings, a file in another encoding and a filter that leaves no training pair are errors naming
the file, line or key; and, property-based, any file either reads back as written or raises."""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from nmt.data.prepare import select_train
from nmt.data.sources import DataError, FileSource, columns, drop_empty, iter_jsonl, iter_lines, iter_parallel, iter_tsv
from nmt.train import train
from nmt.text_lines import read_lines as read_input_lines
from tests.conftest import compose_train

SPLITS = ("train", "valid", "test")


def tsv_source(folder: Path, text: str) -> FileSource:
    for split in SPLITS:
        (folder / f"{split}.tsv").write_text(text, encoding="utf-8", newline="")
    return FileSource(str(folder), "de", "en", files={s: f"{s}.tsv" for s in SPLITS})


def jsonl_source(folder: Path, rows: list[str], **options) -> FileSource:
    for split in SPLITS:
        (folder / f"{split}.jsonl").write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    return FileSource(str(folder), "de", "en", files={s: f"{s}.jsonl" for s in SPLITS}, **options)


def parallel_source(folder: Path, src: bytes, tgt: bytes) -> FileSource:
    for split in SPLITS:
        (folder / f"{split}.de").write_bytes(src)
        (folder / f"{split}.en").write_bytes(tgt)
    return FileSource(str(folder), "de", "en")


# --- rows with more or less than a source and a target ---------------------------------------------
def test_a_tsv_row_with_a_tab_in_its_target_is_an_error_naming_file_and_line(tmp_path):
    source = tsv_source(tmp_path, "ein Haus\ta house\nzwei\ttwo\tand more\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(tmp_path / 'train.tsv'))}, line 2: expected 2 "
                                        r"tab-separated columns \(source<TAB>target\), found 3"):
        source.load()


def test_tsv_blank_rows_and_empty_sides_are_empty_pairs(tmp_path):
    """Dropped and counted downstream (``drop_empty``), never an error, never a shifted row."""
    assert columns(tsv_source(tmp_path, "a\tb\n\n\t\nc\t\n \td\ne\tf\n").load()["train"]) == (
        ["a", "", "", "c", "", "e"], ["b", "", "", "", "d", "f"])


@pytest.mark.parametrize("row, error", [
    ('[1, 2]', "expected a JSON object, found an array"),
    ('"ein Haus"', "expected a JSON object, found a string"),
    ('{"de": "ein Haus"}', "no key 'en' (keys: 'de')"),
    ('{"translation": {"en": "a house"}}', "no key 'de' (keys: 'en')"),
    ('{"translation": "ein Haus"}', "'translation' holds a string, not an object"),
    ('{"de": 3, "en": "three"}', "the 'de' value is a number, not a string"),
    ('{"de": "drei", "en": null}', "the 'en' value is null, not a string"),
    ('{"de": ["ein", "Haus"], "en": "a house"}', "the 'de' value is an array, not a string"),
    ('{"de": "ein\\nHaus", "en": "a house"}', "the 'de' value holds a line break"),
    ('{"de": "ein Haus", "en": "a house"', "not JSON"),
    ('{"de": "ein Haus", "en": "a house", "id": ' + "9" * 5000 + "}", "not JSON (Exceeds the limit"),
    ("[" * 100_000 + "]" * 100_000, "not JSON (nested too deeply)"),
    ('{"de": "\\ud800", "en": "a house"}', "the 'de' value holds a lone surrogate escape"),
    ('{"de": "erste", "en": "first", "de": "zweite"}', "not JSON (the key 'de' is given twice)"),
], ids=["array", "string", "missing_key", "missing_key_in_translation", "translation_not_object", "number", "null",
        "list_value", "line_break", "not_json", "huge_integer", "deep", "surrogate", "duplicate_key"])
def test_a_malformed_jsonl_row_is_an_error_naming_file_and_line(tmp_path, row, error):
    source = jsonl_source(tmp_path, ['{"de": "zwei", "en": "two"}', row])
    with pytest.raises(DataError) as err:
        source.load()
    assert str(err.value).startswith(f"{tmp_path / 'train.jsonl'}, line 2: {error}")
    assert "data.source.bad_rows=skip" in str(err.value)


def test_jsonl_other_keys_are_ignored(tmp_path):
    """Ids, scores and other languages next to the pair are metadata: read, not an error."""
    rows = ['{"id": 7, "de": "eins", "en": "one", "fr": "un", "score": 0.9}',
            '{"id": 8, "translation": {"de": "zwei", "en": "two", "it": "due"}}']
    assert columns(jsonl_source(tmp_path, rows).load()["train"]) == (["eins", "zwei"], ["one", "two"])


def test_a_blank_jsonl_line_is_an_empty_pair(tmp_path):
    """Counted with the empty pairs downstream (``drop_empty``), not skipped unseen."""
    rows = ['{"de": "eins", "en": "one"}', "", '{"de": "zwei", "en": "two"}']
    assert columns(jsonl_source(tmp_path, rows).load()["train"]) == (["eins", "", "zwei"], ["one", "", "two"])


def test_bad_rows_skip_skips_and_counts_malformed_rows(tmp_path, caplog):
    rows = ['{"de": "eins", "en": "one"}', '{"de": 2, "en": "two"}', '[3]', '{"de": "vier", "en": "four"}']
    with caplog.at_level(logging.WARNING):
        data = jsonl_source(tmp_path, rows, bad_rows="skip").load()
    assert columns(data["train"]) == (["eins", "vier"], ["one", "four"])
    assert "train.jsonl: skipped 2 malformed row(s) (data.source.bad_rows=skip), lines [2, 3]" in caplog.text
    assert jsonl_source(tmp_path, rows, bad_rows="skip").describe() != jsonl_source(tmp_path, rows[:1]).describe()
    with pytest.raises(DataError, match="data.source.bad_rows='drop': choose one of error, skip"):
        FileSource(str(tmp_path), "de", "en", bad_rows="drop")


# --- line endings and byte-order marks -------------------------------------------------------------
def test_a_corpus_with_cr_line_endings_is_refused_by_name(tmp_path):
    source = parallel_source(tmp_path, b"ein Haus\rzwei\rdrei\r", b"a house\rtwo\rthree\r")
    with pytest.raises(DataError) as err:
        source.load()
    assert f"{tmp_path / 'train.de'}, line 1: lines end in CR only" in str(err.value)
    assert f"tr '\\r' '\\n' < {tmp_path / 'train.de'}" in str(err.value)


def test_mixed_line_endings_are_refused_naming_the_line(tmp_path):
    source = parallel_source(tmp_path, b"ein Haus\nzwei\rdrei\n", b"a house\ntwo\nthree\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(tmp_path / 'train.de'))}, line 2: a carriage return \(CR\) "
                                        "inside the line"):
        source.load()


def test_crlf_files_read_as_lf(tmp_path):
    """Windows line endings: every reader drops the CR of CRLF (also for the last line without LF)."""
    data = parallel_source(tmp_path, b"ein Haus\r\nzwei\r\n", b"a house\r\ntwo").load()
    assert columns(data["train"]) == (["ein Haus", "zwei"], ["a house", "two"])
    assert columns(tsv_source(tmp_path, "ein Haus\ta house\r\nzwei\ttwo\r\n").load()["train"]) == (
        ["ein Haus", "zwei"], ["a house", "two"])
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"de": "eins", "en": "one"}\r\n{"de": "zwei", "en": "two"}\r\n')
    assert list(iter_jsonl(path, "de", "en")) == [(["eins", "zwei"], ["one", "two"])]


def test_a_utf8_byte_order_mark_is_skipped_by_the_corpus_readers(tmp_path):
    bom = codecs.BOM_UTF8
    data = parallel_source(tmp_path, bom + b"ein Haus\nzwei\n", bom + b"a house\ntwo\n").load()
    assert columns(data["train"]) == (["ein Haus", "zwei"], ["a house", "two"])
    (tmp_path / "bom.jsonl").write_bytes(bom + b'{"de": "eins", "en": "one"}\n')
    assert list(iter_jsonl(tmp_path / "bom.jsonl", "de", "en")) == [(["eins"], ["one"])]


def test_a_utf8_byte_order_mark_is_not_translated(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(codecs.BOM_UTF8 + b"ein Haus\nzwei\n")
    assert read_input_lines(str(path)) == ["ein Haus", "zwei"]


# --- encodings ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("data, looks_like, iconv", [
    ("ein Haus\n".encode("utf-16"), "UTF-16 (byte-order mark FF FE)", "UTF-16"),
    (codecs.BOM_UTF16_BE + "ein Haus\n".encode("utf-16-be"), "UTF-16 (byte-order mark FE FF)", "UTF-16"),
    ("ein Haus\n".encode("utf-32"), "UTF-32 (byte-order mark FF FE 00 00)", "UTF-32"),
    ("ein Haus\nzwei\n".encode("utf-16-le"), "UTF-16LE (no byte-order mark", "UTF-16LE"),
    ("ein Haus\nzwei\n".encode("utf-16-be"), "UTF-16BE (no byte-order mark", "UTF-16BE"),
    ("ein Haus\nCafé\n".encode("cp1252"), "Windows-1252/Latin-1", "WINDOWS-1252"),
], ids=["utf16le_bom", "utf16be_bom", "utf32_bom", "utf16le", "utf16be", "cp1252"])
def test_a_file_in_another_encoding_is_named_with_the_command_that_converts_it(tmp_path, data, looks_like, iconv):
    path = tmp_path / "train.de"
    path.write_bytes(data)
    with pytest.raises(DataError) as err:
        list(iter_lines(path))
    message = str(err.value)
    assert message.startswith(f"{path}, line ") and f"it looks like {looks_like}" in message
    assert f"iconv -f {iconv} -t UTF-8 {path} > {path}.utf8" in message


def test_a_nul_byte_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "train.de"
    path.write_bytes(b"ein Haus\nzwei\x00drei\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}, line 2: a NUL byte"):
        list(iter_lines(path))


def test_utf8_mixed_with_latin1_says_so(tmp_path):
    path = tmp_path / "train.de"
    path.write_bytes("Straße\n".encode() + "Café\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"line 2: invalid UTF-8 .*the file mixes encodings"):
        list(iter_lines(path))


# --- filters that leave no training pair -------------------------------------------------------------
def test_train_max_words_that_removes_every_pair_names_the_key_and_the_count():
    words = np.array([5, 6, 7])
    with pytest.raises(DataError, match=r"data.train_max_words=3 words on both sides \(the filter removed all 3 "
                                        "training pairs\)"):
        select_train(words, words, 3, None, seed=0)


def test_a_length_filter_that_removes_every_training_pair_stops_train_before_zero_steps(tmp_path):
    cfg = compose_train(tmp_path, ["data.max_src_len=2", "data.max_tgt_len=2", "test=false"])
    with pytest.raises(DataError, match=r"data.max_src_len=2 / data.max_tgt_len=2 \(data.too_long=drop\) removed "
                                        r"all 100 training pairs.*set data.too_long=truncate"):
        train(cfg)
    assert not (Path(cfg.paths.output_dir) / "checkpoints").exists()


# --- property-based: any file reads back as written, or raises naming file and line ------------------
# Characters chosen to break readers: tabs, CRs, NUL, a BOM, Unicode line/paragraph separators and
# other whitespace, non-ASCII letters; and any other character except LF, which ends lines (it is
# drawn inside JSON values, where it is escaped).
SPECIAL = ["\t", "\r", "\x00", "\ufeff", "\u2028", "\x85", "\x0b", "\x1c", " ", "\xa0", "é", "猫", "🙂"]
CHARS = st.one_of(st.sampled_from(SPECIAL), st.characters(exclude_categories=("Cs",), exclude_characters="\n"))
TEXT = st.text(CHARS, max_size=12)
ENDINGS = st.sampled_from(["\n", "\r\n", "\r"])
PROPERTY = settings(max_examples=250, deadline=None, database=None)


def write(path: Path, text: str, zipped: bool) -> Path:
    data = text.encode("utf-8")
    if zipped:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def lines_of(rows: list[str], endings: list[str], last: bool) -> str:
    """The rows, each ended by its ending; the last one only when ``last`` (or when it is empty:
    an empty last line exists only by its ending)."""
    text = "".join(r + e for r, e in zip(rows, endings))
    return text if last or not rows or not rows[-1] else text[: -len(endings[-1])]


def expected(pairs: list[tuple[str, str]], boms: tuple[int, ...]) -> tuple[list[str], list[str]]:
    """What a reader must return: the pairs stripped, a BOM skipped at the start of the files
    that begin with side ``boms`` (0: source, 1: target) of the first pair, and (``drop_empty``)
    pairs with an empty side dropped."""
    sides = [[p[k] for p in pairs] for k in (0, 1)]
    for k in boms:
        if pairs:
            sides[k][0] = sides[k][0].removeprefix("\ufeff")
    return drop_empty(*sides, warn=False)[:2]


def read_or_error(read, paths: list[Path], pairs: list[tuple[str, str]], boms: tuple[int, ...], clean: bool) -> None:
    """``read()`` gives exactly ``expected(pairs, boms)``, or (only when the files are not
    ``clean``) a ``DataError`` naming one of ``paths`` and one of its lines."""
    try:
        chunks = list(read())
    except DataError as e:
        found = re.search(r"(\S+), line (\d+): ", str(e))
        assert found and found.group(1) in map(str, paths) and 1 <= int(found.group(2)) <= len(pairs), str(e)
        assert not clean, f"clean input refused: {e}"
        event("DataError naming file and line")
        return
    src = [s for c in chunks for s in c[0]]
    tgt = [t for c in chunks for t in c[1]]
    assert drop_empty(src, tgt, warn=False)[:2] == expected(pairs, boms)
    event("read back exactly")


def lone_cr_or_nul(text: str) -> bool:
    """A NUL, a CR that ends neither a line (CRLF) nor the file, or CRs and no LF at all."""
    return ("\0" in text or any("\r" in line.removesuffix("\r") for line in text.split("\n"))
            or "\r" in text and "\n" not in text)


@PROPERTY
@given(pairs=st.lists(st.tuples(TEXT, TEXT), max_size=8), data=st.data())
def test_parallel_files_read_back_or_name_the_line(tmp_path_factory, pairs, data):
    folder = tmp_path_factory.mktemp("parallel")
    endings = data.draw(st.lists(ENDINGS, min_size=len(pairs), max_size=len(pairs)))
    last, zipped, chunk = data.draw(st.booleans()), data.draw(st.booleans()), data.draw(st.integers(1, 4))
    texts = [lines_of([p[k] for p in pairs], endings, last) for k in (0, 1)]
    paths = [write(folder / f"train.{lang}", text, zipped) for lang, text in zip(("de", "en"), texts)]
    clean = not any(map(lone_cr_or_nul, texts))
    read_or_error(lambda: iter_parallel(*paths, chunk=chunk), paths, pairs, (0, 1), clean)


@PROPERTY
@given(pairs=st.lists(st.tuples(TEXT, TEXT), max_size=8), data=st.data())
def test_tsv_files_read_back_or_name_the_line(tmp_path_factory, pairs, data):
    folder = tmp_path_factory.mktemp("tsv")
    endings = data.draw(st.lists(ENDINGS, min_size=len(pairs), max_size=len(pairs)))
    last, zipped, chunk = data.draw(st.booleans()), data.draw(st.booleans()), data.draw(st.integers(1, 4))
    text = lines_of([f"{s}\t{t}" for s, t in pairs], endings, last)
    path = write(folder / "train.tsv", text, zipped)
    tab_inside = any("\t" in s + t and (s + "\t" + t).strip() for s, t in pairs)
    read_or_error(lambda: iter_tsv(path, chunk=chunk), [path], pairs, (0,), not tab_inside and not lone_cr_or_nul(text))


@PROPERTY
@given(pairs=st.lists(st.tuples(st.text(max_size=12), st.text(max_size=12)), max_size=8), data=st.data())
def test_jsonl_files_read_back_or_name_the_line(tmp_path_factory, pairs, data):
    folder = tmp_path_factory.mktemp("jsonl")
    nested, ascii_only = data.draw(st.booleans()), data.draw(st.booleans())
    crlf, zipped, chunk = data.draw(st.booleans()), data.draw(st.booleans()), data.draw(st.integers(1, 4))
    rows = [json.dumps({"translation": {"de": s, "en": t}} if nested else {"id": i, "de": s, "en": t},
                       ensure_ascii=ascii_only) for i, (s, t) in enumerate(pairs)]
    path = write(folder / "train.jsonl", "".join(r + ("\r\n" if crlf else "\n") for r in rows), zipped)
    line_break = any(c in v.strip() for s, t in pairs for v in (s, t) for c in "\r\n")
    read_or_error(lambda: iter_jsonl(path, "de", "en", chunk=chunk), [path], pairs, (), not line_break)


@pytest.mark.parametrize("content", [gzip.compress(b"ein Haus\n" * 1000)[:-20], b"not gzip\n"], ids=["truncated", "not_gzip"])
def test_a_broken_gzip_file_is_an_error_naming_it(tmp_path, content):
    path = tmp_path / "train.de.gz"
    path.write_bytes(content)
    with pytest.raises(DataError, match=re.escape(f"{path}: not a complete gzip file")):
        read_lines_of(path)


def read_lines_of(path: Path) -> list[str]:
    return [line for lines in iter_lines(path) for line in lines]

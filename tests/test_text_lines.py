"""One set of rules for every text a user gives (nmt.text_lines): the corpus readers, the
input of translate and score (a file, a pipe, standard input) and TSV rows say the same thing
about the same bytes."""

from __future__ import annotations

import gzip
import io
import re
import sys

import pytest

from nmt.data.readers import DataError, iter_lines as corpus_lines, iter_tsv
from nmt.inference.line_streams import read_pairs
from nmt.text_lines import InputError, iter_blocks, iter_lines, read_lines


class Pipe(io.BytesIO):
    """Standard input from a pipe: read once, not seekable."""

    def seekable(self) -> bool:
        return False


def from_stdin(monkeypatch, data: bytes) -> list[str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(Pipe(data))))
    return list(iter_lines(None, alternative=None))


def readers(path, monkeypatch) -> dict:
    """Each front end's reading of the file at ``path``."""
    return {
        "corpus": lambda: [line for block in corpus_lines(path, strip=False) for line in block],
        "translate input": lambda: read_lines(str(path), alternative=None),
        "translate stream": lambda: list(iter_lines(str(path), alternative=None)),
        "stdin": lambda: from_stdin(monkeypatch, path.read_bytes()),
        "score tsv": lambda: [s for s, _ in read_pairs(str(path), None, "strict", [])],
    }


BAD = {  # bytes -> the message after "<name>, line N: "
    "cr only": (b"a\tb\rc\td\r", "line 1: lines end in CR only (old Mac line endings), not LF"),
    "stray cr": (b"a\tb\nc\rx\td\n", "line 2: a carriage return (CR) inside the line"),
    "nul": (b"a\tb\nc\x00\td\n", "line 2: a NUL byte (0x00); a text file holds none"),
    "latin-1": (b"a\tb\nc\xe9\td\n", "line 2: invalid UTF-8 (byte 0xe9 at byte column 2); it looks like Windows-1252/Latin-1"),
    "utf-16": ("a\tb\nc\td\n".encode("utf-16"), "line 1: invalid UTF-8 (byte 0xff at byte column 1); it looks like UTF-16"),
}


@pytest.mark.parametrize("case", BAD)
def test_every_front_end_refuses_the_same_bytes_with_the_same_words(tmp_path, monkeypatch, case):
    data, message = BAD[case]
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    for front_end, read in readers(path, monkeypatch).items():
        with pytest.raises(InputError) as raised:
            read()
        name = "<stdin>" if front_end == "stdin" else str(path)
        assert str(raised.value).startswith(f"{name}, {message}"), (front_end, str(raised.value))
    with pytest.raises(DataError):  # the corpus readers' errors are the data layer's own class
        [*corpus_lines(path)]


def test_every_front_end_reads_bom_and_crlf_alike(tmp_path, monkeypatch):
    path = tmp_path / "in.txt"
    path.write_bytes(b"\xef\xbb\xbfein Haus\ta house\r\n\tx\r\nzwei\tdois\n")
    for front_end, read in readers(path, monkeypatch).items():
        expected = ["ein Haus", "", "zwei"] if front_end == "score tsv" else ["ein Haus\ta house", "\tx", "zwei\tdois"]
        assert read() == expected, front_end


def test_a_tsv_row_of_three_columns_is_refused_by_training_and_scoring_alike(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("a\tb\nc\td\te\n", encoding="utf-8")
    expected = f"{path}, line 2: expected 2 tab-separated columns (source<TAB>target), found 3"
    with pytest.raises(DataError, match="^" + re.escape(expected)):
        [*iter_tsv(path)]
    with pytest.raises(InputError, match="^" + re.escape(expected)):
        [*read_pairs(str(path), None, "strict", [])]


def test_gzip_input_is_read_like_plain_input(tmp_path):
    plain, packed = tmp_path / "in.txt", tmp_path / "in.txt.gz"
    plain.write_bytes(b"one\r\ntwo \xc3\xa9\n")
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_lines(str(packed)) == read_lines(str(plain)) == ["one", "two \u00e9"]
    packed.write_bytes(packed.read_bytes()[:-6])
    with pytest.raises(InputError, match=f"^{packed}: not a complete gzip file"):
        read_lines(str(packed))


def test_replace_keeps_every_line_and_names_the_replaced_ones(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"ok\nbad \xff\nfine\nbad \xfe again\n")
    replaced: list[int] = []
    assert [line for block in iter_blocks(path, 3, errors="replace", replaced=replaced) for line in block] == [
        "ok", "bad \ufffd", "fine", "bad \ufffd again"]
    assert replaced == [2, 4]
    with pytest.raises(InputError, match=r"line 2: invalid UTF-8 .*; or run with errors=replace$"):
        read_lines(str(path))


def test_blocks_of_any_size_give_the_same_lines_and_line_numbers(tmp_path):
    path = tmp_path / "in.txt"
    lines = [f"line {i}" for i in range(1, 12)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for chunk in (1, 2, 5, 11, 50):
        blocks = list(iter_blocks(path, chunk))
        assert [line for block in blocks for line in block] == lines
        assert all(len(block) == chunk for block in blocks[:-1])
    path.write_bytes(path.read_bytes() + b"a\rb\n")
    for chunk in (1, 5, 50):
        with pytest.raises(InputError, match=f"^{path}, line 12: a carriage return"):
            list(iter_blocks(path, chunk))


def test_a_line_over_the_cap_is_an_error_for_corpora_and_cut_for_translation(tmp_path, caplog, monkeypatch):
    """A newline-free file is never read whole: a corpus line over the cap names its line; a line
    to translate is cut at a whole character and the next lines still come."""
    import logging

    import nmt.text_lines as text_lines

    monkeypatch.setattr(text_lines, "MAX_LINE_BYTES", 64)
    path = tmp_path / "long.txt"
    path.write_bytes(b"short\n" + "\u00e9".encode() * 100 + b"\nafter\n")
    with pytest.raises(DataError, match=rf"^{path}, line 2: longer than 64 bytes; a sentence is one line"):
        [*corpus_lines(path)]
    with caplog.at_level(logging.WARNING, logger="nmt.text_lines"):
        lines = list(iter_lines(str(path)))
    assert lines == ["short", "\u00e9" * 32, "after"]
    assert f"{path}, line 2: cut to its first 64 bytes" in caplog.text


class Endless(io.RawIOBase):
    """A stream of one byte forever (``/dev/zero``, ``yes | tr -d '\\n'``), counting what is read."""

    def __init__(self, byte: bytes) -> None:
        self.byte, self.read_bytes = byte, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        buffer[:] = self.byte * len(buffer)
        self.read_bytes += len(buffer)
        return len(buffer)


@pytest.mark.parametrize("byte, error", [(b"\0", "<stdin>, line 1: a NUL byte (0x00); a text file holds none: is it "
                                                 "binary, or in another encoding?"),
                                         (b"a", "<stdin>, line 1: no line end in its first 1,088 bytes; a sentence is "
                                                "one line (is the input text?)")], ids=["dev-zero", "no-line-end"])
def test_an_endless_line_on_stdin_ends_in_one_error(monkeypatch, byte, error):
    """``translate.py < /dev/zero`` read a line to cut forever (the NUL check came after its end);
    now the part of a line read past is checked for NUL as it comes, and bounded."""
    import nmt.text_lines as text_lines

    monkeypatch.setattr(text_lines, "MAX_LINE_BYTES", 64)
    monkeypatch.setattr(text_lines, "MAX_SKIPPED_BYTES", 1024)
    stream = Endless(byte)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(stream, 4096)))
    with pytest.raises(InputError) as raised:
        list(iter_lines(None))
    assert str(raised.value) == error and stream.read_bytes < 8 << 20

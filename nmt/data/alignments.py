"""Word alignments of the training pairs, for guided-alignment training (Garg et al. 2019).

``data.alignments`` names a Pharaoh file of the training split: line i aligns training pair i of
the source (its i-th line, empty pairs included), as ``i-j`` links of a source and a target word
index from 0, the words being the line's whitespace-separated tokens (``i-j`` and possible links
``ipj`` alike), as fast_align, eflomal and Marian write them. Or ``eflomal``: computed from the
prepared text when the data are prepared (``nmt.data.aligners``). ``prepare_alignments`` checks
each line against its pair and writes, beside the prepared data, in a folder keyed by the
file's stamp (or the aligner and its options):

    train.align.src.npy, train.align.tgt.npy   uint32 source / target word of each link, pair after pair
    train.align.offsets.npy                    int64 (N+1,): prepared pair j's links are offsets[j]:offsets[j+1]

(N: the prepared training pairs; pairs with an empty side are dropped as ``nmt.data.prepare``
drops them.) Words become subword positions at batch time (``subword_links``, a function of the
pieces, so a segmentation drawn anew each epoch is lifted the same way): each target subword of
word j is linked to every subword of the source words linked to j. ``AlignedSplit`` adds the
links to a split's items; ``collate_aligned`` puts them in the batch as ``align``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from nmt.data.batching import collate
from nmt.data.prepare import NpyWriter, TextColumn, streaming
from nmt.data.shapes import ShapeBuckets
from nmt.data.sources import DataError
from nmt.data.tokenizer import Tokenizer

WORD_START = "\u2581"  # SentencePiece's word-boundary mark
ALIGNERS = ("eflomal",)
FORMAT = 1


def parse_line(text: str, src_words: int, tgt_words: int, where: str) -> np.ndarray:
    """The (K, 2) links (source word, target word) of one Pharaoh line, checked against the
    pair's word counts; a one-line DataError naming ``where`` (file:line) otherwise."""
    links = []
    for item in text.split():
        left, sep, right = item.replace("p", "-").partition("-")
        if not sep or not left.isdigit() or not right.isdigit():
            raise DataError(f"{where}: {item!r} is not a link 'source-target' of two word indices from 0")
        s, t = int(left), int(right)
        if s >= src_words or t >= tgt_words:
            raise DataError(f"{where}: link {item!r} is out of range: the pair has {src_words} source and "
                            f"{tgt_words} target words (indices from 0)")
        links.append((s, t))
    return np.asarray(sorted(set(links)), dtype=np.uint32).reshape(-1, 2)


def _pairs(source: Any) -> Iterator[tuple[str, str]]:
    """The source's training pairs as it gives them, one by one."""
    for src, tgt, *_ in streaming(source).pairs("train"):
        if len(src) != len(tgt):
            raise DataError(f"split 'train': {len(src)} source vs {len(tgt)} target sentences")
        yield from zip(src, tgt)


def write_links(lines: Iterable[str], pairs: Iterable[tuple[str, str]], out: Path, path: str) -> dict[str, int]:
    """Check ``lines`` (of file ``path``) against ``pairs`` one to one and write the links of the
    pairs whose sides are both non-empty (``train.align.*.npy`` in ``out``); returns counts."""
    writers = {name: NpyWriter(out / f"train.align.{name}.npy", dtype)
               for name, dtype in (("src", np.uint32), ("tgt", np.uint32), ("offsets", np.int64))}
    writers["offsets"].append(np.zeros(1, np.int64))
    lines, pairs = iter(lines), iter(pairs)
    total = kept = unaligned = 0
    number = 0
    for number, (src, tgt) in enumerate(pairs, 1):
        line = next(lines, None)
        if line is None:
            rest = 1 + sum(1 for _ in pairs)
            raise DataError(f"{path}: {number - 1} lines for {number - 1 + rest} training pairs; line i must align "
                            "training pair i")
        src, tgt = src.strip(), tgt.strip()
        if not (src and tgt):  # dropped by prepare, as its alignment
            continue
        links = parse_line(line, len(src.split()), len(tgt.split()), f"{path}:{number}")
        writers["src"].append(links[:, 0])
        writers["tgt"].append(links[:, 1])
        total += len(links)
        kept += 1
        unaligned += not len(links)
        writers["offsets"].append(np.asarray([total], np.int64))
    extra = sum(1 for _ in lines)
    if extra:
        raise DataError(f"{path}: {number + extra} lines for {number} training pairs; line i must align training pair i")
    for w in writers.values():
        w.close()
    return {"pairs": kept, "links": total, "pairs_without_links": unaligned}


def _stamp(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def prepare_alignments(spec: str, source: Any, prepared: Path) -> Path:
    """The folder of the training split's word links (see the module docstring), written first
    when absent: ``spec`` is a Pharaoh file or an aligner's name (``ALIGNERS``)."""
    if getattr(source, "tags", None):
        raise DataError(f"data.alignments={spec}: guided alignment takes a source of one direction; this one tags its "
                        "sources with target languages")
    if spec in ALIGNERS:
        from nmt.data import aligners  # the aligner's package is imported only by who asks for it

        key: dict[str, Any] = {"aligner": spec, **aligners.describe(spec)}
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise DataError(f"data.alignments={spec}: no such file; give a Pharaoh file aligning the training split "
                            f"line by line, or one of: {', '.join(ALIGNERS)}")
        key = {"file": _stamp(path)}
    key["format"] = FORMAT
    folder = prepared / "alignments" / hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    if (folder / "manifest.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        if spec in ALIGNERS:
            texts = [TextColumn(prepared, f"train.{side}") for side in ("src", "tgt")]
            rows = [column.rows(0, len(column)) for column in texts]
            links_file = tmp / "train.align"
            aligners.align(spec, rows[0], rows[1], links_file)
            with open(links_file, encoding="utf-8") as lines:
                counts = write_links(lines, zip(*rows), tmp, str(links_file))
            links_file.unlink()
        else:
            with open(path, encoding="utf-8", errors="strict") as lines:
                try:
                    counts = write_links(lines, _pairs(source), tmp, str(path))
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a line)") from None
        (tmp / "manifest.json").write_text(json.dumps({"key": key, **counts}, indent=1) + "\n")
        try:
            tmp.rename(folder)
        except OSError:  # another process wrote it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


class WordLinks:
    """The stored links of the prepared training pairs, memory-mapped: ``[j]`` gives pair j's (K, 2)."""

    def __init__(self, folder: Path) -> None:
        load = lambda name: np.load(folder / f"train.align.{name}.npy", mmap_mode="r")  # noqa: E731
        self.src, self.tgt, self.offsets = load("src"), load("tgt"), load("offsets")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, j: int) -> np.ndarray:
        a, b = int(self.offsets[j]), int(self.offsets[j + 1])
        return np.stack([np.asarray(self.src[a:b]), np.asarray(self.tgt[a:b])], axis=1).astype(np.int64)


def word_starts(vocab: Tokenizer) -> np.ndarray:
    """(V,) bool: whether each piece of ``vocab`` starts a word (begins with "▁")."""
    return np.array([vocab.sp.id_to_piece(i).startswith(WORD_START) for i in range(vocab.vocab_size)])


def words_of_pieces(ids: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The word index of each piece of one sentence (the first piece starts a word whatever it is)."""
    begins = starts[np.asarray(ids, dtype=np.int64)]
    if len(begins):
        begins[0] = True
    return np.cumsum(begins) - 1


def subword_links(src_words: np.ndarray, tgt_words: np.ndarray, links: np.ndarray) -> np.ndarray:
    """Word links lifted to subwords: ``src_words``/``tgt_words`` give the word of each piece
    (``words_of_pieces``), ``links`` (K, 2) the (source word, target word) links -> (L, 2)
    (target piece, source piece) pairs: each piece of target word j with every piece of the source
    words linked to j. Links to words past the pieces (a truncated side) are dropped."""
    if not len(links) or not len(src_words) or not len(tgt_words):
        return np.zeros((0, 2), dtype=np.int64)
    linked = np.zeros((int(tgt_words[-1]) + 1, int(src_words[-1]) + 1), dtype=bool)  # (target words, source words)
    inside = (links[:, 0] <= src_words[-1]) & (links[:, 1] <= tgt_words[-1])
    linked[links[inside, 1], links[inside, 0]] = True
    pieces = linked[tgt_words][:, src_words]  # (target pieces, source pieces)
    return np.argwhere(pieces)


class AlignedSplit(Dataset):
    """The training split's items with their subword links: (i, source ids, target ids, (L, 2)
    target/source piece links). ``base``: a ``TokenizedSplit`` or a split that changes its pairs
    (``nmt.data.augment.AugmentedSplit``; links are lifted from the pieces it gives, and links to
    words a change removed are dropped); its other attributes are read through."""

    def __init__(self, base: Any, links: WordLinks, vocab: tuple[Tokenizer, Tokenizer]) -> None:
        self.base, self.links = base, links
        self.starts = tuple(word_starts(v) for v in vocab)
        index = getattr(base, "base", base).index
        self.rows = np.asarray(index)

    def __len__(self) -> int:
        return len(self.base)

    def __getattr__(self, name: str) -> Any:  # lengths_of_epoch of an augmented split, ...
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def _with_links(self, item: tuple[int, np.ndarray, np.ndarray]) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        i, src, tgt = item
        src_words, tgt_words = (words_of_pieces(ids, s) for ids, s in zip((src, tgt), self.starts))
        return i, src, tgt, subword_links(src_words, tgt_words, self.links[int(self.rows[i])])

    def __getitem__(self, i: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        return self._with_links(self.base[i])

    def __getitems__(self, indices: list[int]) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        return [self._with_links(item) for item in self.base.__getitems__(indices)]


def collate_aligned(items: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]],
                    shapes: ShapeBuckets | None = None) -> dict[str, Any]:
    """``nmt.data.batching.collate``'s batch plus ``align`` (L, 3) int64: (row, target position,
    source position) of every subword link, a target position t being the piece ``tgt_out`` holds
    at t (the step that writes it)."""
    batch = collate([item[:3] for item in items], shapes)
    parts = [np.concatenate([np.full((len(links), 1), b), links], axis=1) for b, (*_, links) in enumerate(items)]
    batch["align"] = torch.from_numpy(np.concatenate(parts).astype(np.int64) if parts else np.zeros((0, 3), np.int64))
    return batch

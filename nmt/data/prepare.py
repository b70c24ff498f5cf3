"""Prepared data: a corpus streamed once into memory-mapped arrays, `python -m nmt.data.prepare data=<name>`.

`prepare()` writes `<cache_dir>/prepared/<key>/`, where the key hashes what the source says about
itself (`describe()`: file paths, sizes and modification times; generator or hub arguments), the
tokenizer options (or the fingerprints of `vocab_from`) and, when a tokenizer is trained, the
training-pair selection it is trained on. Nothing large is hashed, so finding the folder again
costs a few `stat` calls. The folder holds, per split and side (`train.src.tokens.npy`, ...):

    text.npy, text_offsets.npy   uint8 UTF-8 of the stripped sentences back to back, int64 (N+1,)
    tokens.npy, offsets.npy      uint16 ids (uint32 for vocabularies over 65,536), int64 (N+1,)
    lengths.npy                  uint16 subwords per sentence (clipped at 65,535)
    words.npy                    uint32 words per sentence (source: characters if src_words=chars)

plus `spm.model` (or `src.model` / `tgt.model`) and `manifest.json` (pair counts, dropped pairs
and why, tokenizer fingerprints, each source file's size and modification time). Steps: stream
the source in chunks (empty pairs dropped), writing text and word counts; pick the training
pairs the tokenizer sees (`select_train`); train SentencePiece on `input_sentence_size`
sentences drawn across all of them; encode every split with worker processes that each read
their own rows of the text. With `vocab_from`, a reader of one split (`nmt-evaluate` reads the
test split) prepares that split alone, and the training text without encoding it when it counts
training words, in a folder of its own (`splits` in the key). Everything is written into a temporary folder that is renamed when
complete, so an interrupted preparation is never used. Memory stays near one chunk plus the
tokenizer's training sample, whatever the corpus size.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import itertools
import json
import logging
import multiprocessing
import multiprocessing.pool
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from nmt.data.sources import SPLITS, DataError, columns, drop_empty
from nmt.data.tokenizer import Tokenizer, options_with_defaults, text_hash, train_sentencepiece
from nmt.cli_io import FULL, configured, hydra_command, write_failure
from nmt.machine import usable_cores

log = logging.getLogger(__name__)

FORMAT = 1             # bump when the folder's layout or content changes
TMP_PREFIX = ".tmp-"   # a folder being written, renamed when complete
UINT16_VOCAB = 65536   # vocabularies up to this size store ids as uint16
ENCODE_CHUNK = 20000   # sentences a worker encodes at a time
SIDES = ("src", "tgt")


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """The smallest unsigned type that holds every id of the vocabulary."""
    return np.uint16 if vocab_size <= UINT16_VOCAB else np.uint32


class NpyWriter:
    """A 1-D `.npy` file written by appending; `close()` writes the final length into its header.

    numpy leaves room in a header for the first axis to grow to 21 digits, so the header is
    rewritten in place and nothing is ever held or copied whole.
    """

    def __init__(self, path: Path, dtype: Any) -> None:
        self.path, self.dtype, self.length = path, np.dtype(dtype), 0
        self.file = open(path, "wb")
        self._header()
        self.data_start = self.file.tell()

    def _header(self) -> None:
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.length,)}
        self.file.seek(0)
        np.lib.format.write_array_header_1_0(self.file, header)

    def append(self, values: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.length += len(values)

    def close(self) -> None:
        self._header()
        if self.file.tell() != self.data_start:
            raise RuntimeError(f"{self.path}: the .npy header changed size")
        self.file.close()


def data_offset(path: Path) -> int:
    """Byte offset of the data in a `.npy` file."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        read(f)
        return f.tell()


class TextColumn:
    """Sentences stored by `prepare` (`<split>.<side>.text.npy` + `text_offsets.npy`), read row
    ranges at a time with `os.pread`: nothing is memory-mapped, so reading leaves no pages resident."""

    def __init__(self, folder: Path, name: str) -> None:
        self.path = folder / f"{name}.text.npy"
        self.offsets = np.load(folder / f"{name}.text_offsets.npy", mmap_mode="r")
        self.start = data_offset(self.path)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self, begin: int, end: int) -> list[str]:
        """Sentences begin..end-1."""
        offsets = np.asarray(self.offsets[begin : end + 1]) - int(self.offsets[begin])
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = os.pread(fd, int(offsets[-1]), self.start + int(self.offsets[begin]))
        finally:
            os.close(fd)
        bounds = offsets.tolist()
        return [data[a:b].decode("utf-8") for a, b in zip(bounds, bounds[1:])]

    def take(self, index: np.ndarray) -> list[str]:
        """The sentences at `index` (sorted rows read in runs of neighbours)."""
        out = []
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i in np.asarray(index).tolist():
                a, b = int(self.offsets[i]), int(self.offsets[i + 1])
                out.append(os.pread(fd, b - a, self.start + a).decode("utf-8"))
        finally:
            os.close(fd)
        return out


# -- which training pairs -------------------------------------------------------------------
def select_train(src_words: np.ndarray, tgt_words: np.ndarray, max_words: int | None,
                 num_pairs: int | None, seed: int) -> tuple[np.ndarray | None, dict[str, int]]:
    """Rows of the training split kept by `train_max_words` then `train_pairs` (a random subset
    drawn with `seed`, in corpus order); None keeps them all. Returns (rows, stats)."""
    index, stats = None, {}
    if max_words is not None:
        index = np.flatnonzero((src_words <= max_words) & (tgt_words <= max_words))
        stats["over_max_words_dropped"] = len(src_words) - len(index)
        log.info("train: kept %d of %d pairs of at most %d words", len(index), len(src_words), max_words)
        if not len(index):
            raise DataError(f"no training pair has at most data.train_max_words={max_words} words on both sides "
                            f"(the filter removed all {len(src_words)} training pairs); raise the limit or set it "
                            "to null")
    n = len(src_words) if index is None else len(index)
    if num_pairs is not None and n > num_pairs:
        pick = np.sort(np.random.default_rng(seed).choice(n, num_pairs, replace=False))
        index = pick if index is None else index[pick]
        stats["subsampled_to"] = num_pairs
    return index, stats


def selection_key(max_words: int | None, num_pairs: int | None, seed: int) -> dict[str, Any]:
    """The options `select_train` depends on (part of the key when a tokenizer is trained on them)."""
    return {"train_max_words": max_words, "train_pairs": num_pairs,
            "seed": seed if num_pairs is not None else None}


def folder_key(description: Mapping[str, Any], tokenizer: Mapping[str, Any], src_words: str) -> dict[str, Any]:
    return {"format": FORMAT, "source": description, "tokenizer": tokenizer, "src_words": src_words}


def folder_for(cache_dir: Path, key: Mapping[str, Any]) -> Path:
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    return Path(cache_dir) / "prepared" / digest


class _Loaded:
    """A source with only `load() -> DatasetDict` (an older custom source): loaded whole and keyed
    on a hash of its text, as before streaming sources."""

    def __init__(self, source: Any) -> None:
        self.source, self.data = source, source.load()
        missing = [s for s in SPLITS if s not in self.data]
        if missing:
            raise DataError(f"the source gave splits {list(self.data)}; missing {missing}")

    def describe(self) -> dict[str, Any]:
        return {"type": type(self.source).__qualname__,
                "text": text_hash(*(col for s in SPLITS for col in columns(self.data[s])))}

    def pairs(self, split: str, chunk: int = 0) -> Iterator[tuple[list[str], list[str]]]:
        yield columns(self.data[split])


def streaming(source: Any) -> Any:
    """`source` itself when it streams (`describe` + `pairs`), else a `_Loaded` wrapper."""
    return source if hasattr(source, "pairs") and hasattr(source, "describe") else _Loaded(source)


def source_sample(source: Any, split: str, size: int = 5000) -> list[str]:
    """The first `size` source sentences of `split`, without a leading target-language tag: what
    `nmt.languages.writing.text_unit` reads when the source language's length unit is not known."""
    tags, out, source = frozenset(getattr(source, "tags", ())), [], streaming(source)
    source.describe()  # a source plans its reading there (a FileSource finds its files)
    for src, *_ in source.pairs(split):
        for t in src:
            first, _, rest = t.partition(" ")
            out.append(rest if tags and first in tags else t)
        if len(out) >= size:
            break
    return out[:size]


# -- the steps --------------------------------------------------------------------------------
def _source_words(texts: list[str], chars: bool, tags: frozenset[str]) -> Iterator[int]:
    """Words (or, with `chars`, non-space characters) of each source sentence, a leading
    target-language tag (`nmt.data.multilingual`) not counted: lengths are the sentence's own."""
    for t in texts:
        if tags:
            first, _, rest = t.partition(" ")
            t = rest if first in tags else t
        yield len("".join(t.split())) if chars else len(t.split())


def _read_split(source: Any, split: str, out: Path, src_words: str) -> dict[str, int]:
    """Stream `split` into text, text offsets and word counts; returns its pair counts. A source
    whose chunks carry a third array, each pair's origin (`nmt.data.multilingual`), also gets
    `<split>.origin.npy` (uint16, one per kept pair)."""
    tags = frozenset(getattr(source, "tags", ()))
    prefixed = getattr(source, "target_prefixed", False)  # targets start with a language tag, not a word of theirs
    origins: NpyWriter | None = None
    writers = {}
    for side in SIDES:
        writers[side, "text"] = NpyWriter(out / f"{split}.{side}.text.npy", np.uint8)
        writers[side, "text_offsets"] = NpyWriter(out / f"{split}.{side}.text_offsets.npy", np.int64)
        writers[side, "words"] = NpyWriter(out / f"{split}.{side}.words.npy", np.uint32)
        writers[side, "text_offsets"].append(np.zeros(1, np.int64))
    ends = {side: 0 for side in SIDES}
    read = empty = 0
    start = last_log = time.perf_counter()
    for src, tgt, *origin in source.pairs(split):
        read += len(src)
        if origin:
            kept = np.fromiter((bool(s.strip() and t.strip()) for s, t in zip(src, tgt)), bool, len(src))
            origins = origins or NpyWriter(out / f"{split}.origin.npy", np.uint16)
            origins.append(np.asarray(origin[0], np.uint16)[kept])
        src, tgt, dropped = drop_empty(src, tgt, split, warn=False)
        empty += dropped
        for side, texts in zip(SIDES, (src, tgt)):
            data = [t.encode("utf-8") for t in texts]
            sizes = np.fromiter(map(len, data), np.int64, len(data))
            writers[side, "text"].append(np.frombuffer(b"".join(data), np.uint8))
            writers[side, "text_offsets"].append(ends[side] + np.cumsum(sizes))
            ends[side] += int(sizes.sum())
            counts = _source_words(texts, src_words == "chars", tags) if side == "src" else \
                _source_words(texts, False, tags) if prefixed else (len(t.split()) for t in texts)
            writers[side, "words"].append(np.fromiter(counts, np.uint32, len(texts)))
        if time.perf_counter() - last_log > 30:
            last_log = time.perf_counter()
            log.info("%s: read %d pairs (%.0f/s)", split, read, read / (last_log - start))
    for w in [*writers.values(), *([origins] if origins else [])]:
        w.close()
    if empty:
        log.warning("%s: dropped %d of %d pairs with an empty side", split, empty, read)
    pairs = read - empty
    if not pairs:
        raise DataError(f"split {split!r} has no sentence pairs")
    log.info("%s: %d pairs in %.1fs", split, pairs, time.perf_counter() - start)
    return {"read": read, "empty_dropped": empty, "pairs": pairs}


def _sample(out: Path, rows: np.ndarray | None, n: int, sides: tuple[str, ...], size: int) -> list[str]:
    """At most `size` training sentences of `sides` drawn at random across all of them (in corpus
    order, sources before targets), from the rows `rows` (None: all `n`)."""
    m = n if rows is None else len(rows)
    total = m * len(sides)
    pick = np.arange(total) if total <= size else np.sort(np.random.default_rng(0).choice(total, size, replace=False))
    out_texts: list[str] = []
    for k, side in enumerate(sides):
        mine = pick[(pick >= k * m) & (pick < (k + 1) * m)] - k * m
        out_texts += TextColumn(out, f"train.{side}").take(mine if rows is None else rows[mine])
    return out_texts


def _train_tokenizers(out: Path, rows: np.ndarray | None, n: int, options: Mapping[str, Any]) -> dict[str, str]:
    """SentencePiece model file name per side, trained into `out`."""
    size = int(options["input_sentence_size"] or 0) or n * 2
    start = time.perf_counter()
    if options["joint"]:
        train_sentencepiece(_sample(out, rows, n, SIDES, size), out, options, name="spm")
        files = {"src": "spm.model", "tgt": "spm.model"}
    else:
        for side in SIDES:
            train_sentencepiece(_sample(out, rows, n, (side,), size), out, options, name=side)
        files = {side: f"{side}.model" for side in SIDES}
    log.info("trained SentencePiece (%s, %s) in %.1fs", options["model_type"],
             "joint" if options["joint"] else "per side", time.perf_counter() - start)
    return files


_WORKER: dict[str, Any] = {}


def _init_worker(protos: dict[str, bytes], threads: int = 1) -> None:
    """Load the models; `threads`: SentencePiece's own encoding threads (1 in a worker process)."""
    _WORKER["sp"] = {side: spm.SentencePieceProcessor(model_proto=p, num_threads=threads) for side, p in protos.items()}


def _init_worker_process(protos: dict[str, bytes]) -> None:
    """A worker ignores Ctrl-C (which reaches the whole process group): the parent stops the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _init_worker(protos)


def _start_pool(workers: int, protos: dict[str, bytes], started: list[multiprocessing.pool.Pool]) -> None:
    """The worker processes, appended to ``started`` (whose owner terminates them), started with
    SIGINT held back: a Ctrl-C arriving while they fork would run its handler inside CPython's
    after-fork hooks, which ignore the KeyboardInterrupt (the preparation and the training went
    on). Held back, it is raised once they exist and ``started`` holds them."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    hold = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if hold else None
    try:
        started.append(multiprocessing.get_context(method).Pool(workers, _init_worker_process, (protos,)))
    finally:
        if hold:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _encode(task: tuple[str, str, int, int, str, str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, subwords per sentence) of rows begin..end-1 of `<split>.<side>`."""
    folder, name, begin, end, side, dtype = task
    texts = TextColumn(Path(folder), name).rows(begin, end)
    ids = _WORKER["sp"][side].encode(texts, out_type=int)
    sizes = np.fromiter(map(len, ids), np.int64, len(ids))
    return np.fromiter(itertools.chain.from_iterable(ids), dtype, int(sizes.sum())), sizes


def _encode_all(out: Path, protos: dict[str, bytes], dtypes: dict[str, Any], workers: int,
                splits: tuple[str, ...] = SPLITS) -> dict[str, int]:
    """Write tokens, offsets and lengths of every split and side; returns tokens per split.side."""
    tasks = []
    for split in splits:
        for side in SIDES:
            n = len(np.load(out / f"{split}.{side}.text_offsets.npy", mmap_mode="r")) - 1
            tasks += [(str(out), f"{split}.{side}", b, min(b + ENCODE_CHUNK, n), side, np.dtype(dtypes[side]).str)
                      for b in range(0, n, ENCODE_CHUNK)]
    pools: list[multiprocessing.pool.Pool] = []
    counts: dict[str, int] = {}
    writers: dict[str, tuple[NpyWriter, NpyWriter, NpyWriter]] = {}
    start = time.perf_counter()
    try:
        if workers > 1 and len(tasks) > 4 * workers:  # small corpora: not worth starting processes
            _start_pool(workers, protos, pools)
            results = pools[0].imap(_encode, tasks)
        else:
            _init_worker(protos, threads=-1)  # SentencePiece's threads (all cores) encode each chunk
            results = map(_encode, tasks)
        for task, (ids, sizes) in zip(tasks, results):
            name = task[1]
            if name not in writers:
                _close(writers)
                writers = {name: (NpyWriter(out / f"{name}.tokens.npy", task[5]),
                                  NpyWriter(out / f"{name}.offsets.npy", np.int64),
                                  NpyWriter(out / f"{name}.lengths.npy", np.uint16))}
                writers[name][1].append(np.zeros(1, np.int64))
                counts[name] = 0
            tokens, offsets, lengths = writers[name]
            tokens.append(ids)
            offsets.append(counts[name] + np.cumsum(sizes))
            lengths.append(np.minimum(sizes, np.iinfo(np.uint16).max))
            counts[name] += len(ids)
        _close(writers)
    finally:
        for pool in pools:
            pool.terminate()
    log.info("encoded %d sentences in %.1fs (%s)", sum(t[3] - t[2] for t in tasks), time.perf_counter() - start,
             f"{workers} worker processes" if pools else "in process")
    return counts


def _close(writers: dict[str, tuple[NpyWriter, ...]]) -> None:
    for group in writers.values():
        for w in group:
            w.close()


def default_workers() -> int:
    return usable_cores()


def prepare(source: Any, cache_dir: str | Path, tokenizer: Mapping[str, Any] | None = None,
            vocab: tuple[Tokenizer, Tokenizer] | None = None, src_words: str = "words",
            train_max_words: int | None = None, train_pairs: int | None = None, seed: int = 0,
            workers: int | None = None, splits: tuple[str, ...] = SPLITS,
            text_only: tuple[str, ...] = ()) -> tuple[Path, bool]:
    """The prepared folder of `source` (see the module docstring), written first when absent.

    vocab: tokenizers to encode with (`vocab_from`); None trains SentencePiece with the options
    `tokenizer` on the training pairs `select_train` keeps. workers: encoding processes (default
    one per core; 0 or 1 encodes in this process). splits: the splits to prepare, all unless
    `vocab` is given (a tokenizer is trained on the training split); text_only: further splits
    whose text and word counts are written, not encoded. Returns (folder, whether it was written
    now).
    """
    splits, text_only = tuple(splits), tuple(s for s in text_only if s not in splits)
    if not splits or any(s not in SPLITS for s in splits + text_only):
        raise ValueError(f"splits={list(splits + text_only)}: choose among {', '.join(SPLITS)}")
    if vocab is None and "train" not in splits:
        raise ValueError(f"splits={list(splits)}: a tokenizer is trained on the training split; give vocab_from "
                         "to prepare other splits alone")
    options = options_with_defaults(tokenizer)
    source = streaming(source)
    if vocab is not None:
        spec: dict[str, Any] = {"vocab": [vocab[0].fingerprint, vocab[1].fingerprint], "joint": vocab[0] is vocab[1]}
    else:
        spec = {"options": options, "spm": spm.__version__,
                "selection": selection_key(train_max_words, train_pairs, seed)}
    if splits != SPLITS:
        spec["splits"] = {"encoded": list(splits), "text": list(text_only)}
    key = folder_key(source.describe(), spec, src_words)
    folder = folder_for(Path(cache_dir), key)
    if (folder / "manifest.json").is_file():
        mark_used(folder)
        return folder, False
    start = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f"{TMP_PREFIX}{folder.name}-"))
    try:
        log.info("preparing %s in %s", json.dumps(key["source"])[:300], folder)
        counted = {split: _read_split(source, split, tmp, src_words) for split in splits + text_only}
        if vocab is None:
            words = [np.load(tmp / f"train.{side}.words.npy", mmap_mode="r") for side in SIDES]
            rows, selection = select_train(*words, train_max_words, train_pairs, seed)
            files = _train_tokenizers(tmp, rows, counted["train"]["pairs"], options)
            toks = {side: Tokenizer(tmp / files[side]) for side in SIDES}
        else:
            selection, files = {}, {"src": None, "tgt": None}
            toks = dict(zip(SIDES, vocab))
        dtypes = {side: token_dtype(toks[side].vocab_size) for side in SIDES}
        protos = {side: toks[side].sp.serialized_model_proto() for side in SIDES}
        counts = _encode_all(tmp, protos, dtypes, default_workers() if workers is None else workers, splits)
        for split in splits:
            counted[split] |= {f"{side}_tokens": counts[f"{split}.{side}"] for side in SIDES}
        manifest = {
            "format": FORMAT, "key": key, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "seconds": round(time.perf_counter() - start, 1), "splits": counted,
            "origins": list(getattr(source, "origins", [])),  # the names of <split>.origin.npy's values
            "train_selection": selection,  # training pairs the tokenizer saw (as selected again by the datamodule)
            "tokenizer": {side: {"file": files[side], "fingerprint": toks[side].fingerprint,
                                 "vocab_size": toks[side].vocab_size, "dtype": np.dtype(dtypes[side]).name}
                          for side in SIDES},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        try:
            tmp.rename(folder)  # atomic: nobody ever sees half a folder
        except OSError:  # another process finished first; use its folder
            log.info("%s was prepared by another process meanwhile", folder)
            return folder, False
    except OSError as e:
        if e.errno not in FULL | {errno.EIO}:
            raise
        raise write_failure(folder, e, "nothing half-written is kept in the cache") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("prepared %s in %.1fs: %s", folder, time.perf_counter() - start,
             ", ".join(f"{s} {counted[s]['pairs']}" for s in splits))
    return folder, True


def mark_used(folder: Path) -> None:
    """Set the manifest's modification time to now: when the folder was last used
    (`nmt.data.cache` prunes by it). A read-only cache is left as it is."""
    try:
        os.utime(folder / "manifest.json")
    except OSError:
        pass


def read_manifest(folder: Path) -> dict[str, Any]:
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise DataError(f"{folder}: prepared data of format {manifest.get('format')}, expected {FORMAT}; "
                        "delete the folder to prepare it again")
    return manifest


def prepare_configured(cfg: Any) -> None:
    """Prepare the data ``cfg.data`` configures (``python -m nmt.data.prepare``)."""
    from hydra.utils import instantiate

    dm = configured(lambda: instantiate(cfg.data, vocab_loader=instantiate(cfg.vocab_loader)))  # the config names the reader
    dm.prepare_data(workers=cfg.get("workers"))
    manifest = read_manifest(dm.prepared_dir)
    log.info("prepared data in %s\n%s", dm.prepared_dir, json.dumps(manifest["splits"], indent=1))


main = hydra_command("prepare", prepare_configured)  # python -m nmt.data.prepare: nmt/conf/prepare.yaml


if __name__ == "__main__":
    main()

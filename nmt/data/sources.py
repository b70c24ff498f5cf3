"""Where sentence pairs come from: every source streams them in chunks.

Each source has `describe() -> dict` (what the corpus is, cheaply: file sizes and modification
times, generator options, hub arguments; the key of the prepared data) and `pairs(split)`,
which yields (source sentences, target sentences) chunks for `train`, `valid` and `test`;
`load()` gives the whole corpus as a `datasets.DatasetDict` for small corpora and inspection.
Validation, tokenization and filtering happen once, downstream, in `nmt.data.prepare`. Local
files (plain or gzip) are read in Python by `nmt.data.readers` (not with `load_dataset("text")`)
so that every problem names the file and line; a Hugging Face hub dataset, streamed, is the
fallback.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
from omegaconf import DictConfig, ListConfig, OmegaConf

from nmt.data.readers import (BAD_ROWS, CHUNK, DataError, Pairs, iter_jsonl, iter_lines, iter_parallel,  # noqa: F401
                              iter_tsv, read_lines)

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
# Line-aligned provenance or documentation next to the text: never a language.
NOT_LANGUAGES = {"session", "origin", "attribution", "md", "txt", "json", "yaml", "yml", "py",
                 "sh", "gz", "zip", "tar", "tsv", "jsonl", "csv", "log"}
HUB_SPLIT_ALIASES = {"valid": ("validation", "dev", "val"), "test": ("test",), "train": ("train",)}
GENERATOR_VERSION = 1  # bump when nmt.data.synthetic generates other pairs for the same options


def plain(obj: Any) -> Any:
    """A DictConfig/ListConfig as plain dicts and lists; anything else unchanged."""
    return OmegaConf.to_container(obj, resolve=True) if isinstance(obj, (DictConfig, ListConfig)) else obj


class _LocalMissing(DataError):
    """Local files are absent (the only case in which the hub fallback is tried)."""


def make_dataset(src: list[str], tgt: list[str]) -> datasets.Dataset:
    """An in-memory `Dataset` with string columns `src`, `tgt`."""
    return datasets.Dataset(pa.table({"src": pa.array(src, pa.string()),
                                      "tgt": pa.array(tgt, pa.string())}))


def columns(ds: datasets.Dataset) -> tuple[list[str], list[str]]:
    """The `src` and `tgt` columns as Python lists (None becomes "")."""
    table = ds.with_format("arrow")[:]
    return ([s or "" for s in table.column("src").to_pylist()],
            [t or "" for t in table.column("tgt").to_pylist()])


def in_memory(source: Any) -> datasets.DatasetDict:
    """Every split of a streaming source (`describe` + `pairs`) as an in-memory `DatasetDict`:
    for small corpora and inspection; training streams `pairs` instead."""
    source.describe()
    out = {}
    for split in SPLITS:
        chunks = list(source.pairs(split))
        out[split] = make_dataset([s for c in chunks for s in c[0]], [t for c in chunks for t in c[1]])
    return datasets.DatasetDict(out)


def drop_empty(src: list[str], tgt: list[str], split: str = "", warn: bool = True
               ) -> tuple[list[str], list[str], int]:
    """Strip both sides and drop pairs with a blank side; returns (src, tgt, number dropped)."""
    if len(src) != len(tgt):
        raise DataError(f"split {split!r}: {len(src)} source vs {len(tgt)} target sentences")
    pairs = [(s.strip(), t.strip()) for s, t in zip(src, tgt)]
    kept = [(s, t) for s, t in pairs if s and t]
    dropped = len(pairs) - len(kept)
    if dropped and warn:
        log.warning("%s: dropped %d of %d pairs with an empty side", split, dropped, len(pairs))
    return [s for s, _ in kept], [t for _, t in kept], dropped


def _file_stamp(path: Path) -> list[Any]:
    """What says a file changed, without reading it: [path, size, modification time in ns]."""
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


MAX_SYNTHETIC_WORDS = 1000  # the longest synthetic sentence a config may ask for


class SyntheticSource:
    """Pairs from the project's synthetic-language generator (`nmt.data.synthetic`).

    The same pairs as the files `synthetic.write_corpus(dir, {train: .., valid: .., test: ..},
    seed, lengths=...)` writes: split i is generated with seed `seed * 1000 + i`. Train lengths
    follow `lengths`, valid lengths `valid_lengths` (default: `lengths`), the test split
    `test_lengths` (default uniform, so that every source-length bucket of the test report holds
    about as many sentences). Its made-up languages are written with spaces between words
    (`length_unit`), whatever codes a config gives them (`src`, `tgt`).
    """

    length_unit = "words"  # how a source's length is counted (data.src_words=auto): known, not judged from the text

    def __init__(self, num_pairs: int = 50000, valid_pairs: int = 500, test_pairs: int = 1000,
                 seed: int = 0, min_len: int = 3, max_len: int = 60, lengths: str = "natural",
                 test_lengths: str = "uniform", median_len: float = 15, valid_lengths: str | None = None) -> None:
        from nmt.data.synthetic import LENGTHS

        valid_lengths = valid_lengths or lengths
        for key, value in (("lengths", lengths), ("valid_lengths", valid_lengths), ("test_lengths", test_lengths)):
            if value not in LENGTHS:
                raise DataError(f"data.source.{key}={value!r}: choose one of {', '.join(LENGTHS)}")
        if not (isinstance(min_len, int) and isinstance(max_len, int) and 1 <= min_len <= max_len <= MAX_SYNTHETIC_WORDS):
            raise DataError(f"data.source.min_len={min_len}, max_len={max_len}: sentence lengths are whole numbers of "
                            f"words with 1 <= min_len <= max_len <= {MAX_SYNTHETIC_WORDS}")
        # "natural" lengths are drawn around the median and kept when in [min_len, max_len]: within a
        # factor 2 of that range, about one draw in eight or more is kept
        if not (isinstance(median_len, (int, float)) and min_len / 2 <= median_len <= 2 * max_len):
            raise DataError(f"data.source.median_len={median_len}: choose a length from {min_len / 2:g} to "
                            f"{2 * max_len} (half min_len={min_len} to twice max_len={max_len})")
        self.sizes = {"train": num_pairs, "valid": valid_pairs, "test": test_pairs}
        self.lengths = {"train": lengths, "valid": valid_lengths, "test": test_lengths}
        self.seed, self.min_len, self.max_len, self.median_len = seed, min_len, max_len, median_len

    def describe(self) -> dict[str, Any]:
        """Everything the pairs depend on (the key of the prepared data)."""
        return {"type": "synthetic", "generator": GENERATOR_VERSION, "sizes": self.sizes, "lengths": self.lengths,
                "seed": self.seed, "min_len": self.min_len, "max_len": self.max_len, "median_len": self.median_len}

    def pairs(self, split: str, chunk: int = CHUNK) -> Iterator[Pairs]:
        """The pairs of `split`, `chunk` at a time (one seed per split: sizes change nothing else)."""
        from nmt.data.synthetic import iter_pairs

        pairs = iter_pairs(self.sizes[split], seed=self.seed * 1000 + SPLITS.index(split), min_len=self.min_len,
                           max_len=self.max_len, lengths=self.lengths[split], median_len=self.median_len)
        while block := list(itertools.islice(pairs, chunk)):
            yield [s for s, _ in block], [t for _, t in block]

    def load(self) -> datasets.DatasetDict:
        return in_memory(self)


class FileSource:
    """A parallel corpus in a folder (`<stem>.<lang>` files), explicit files, or on the hub.

    `splits` maps split -> file stem (Multi30k: valid -> val, test -> test_2016_flickr).
    `files` gives explicit per-split files instead: {train: {src: a.de, tgt: a.en}} or
    {train: train.tsv | train.jsonl}, relative to `path` when set. Any file may be
    gzip-compressed (`.gz` appended). `bad_rows`: a malformed TSV/JSONL row is an `error`
    (naming file and line), or (`skip`) skipped, counted and logged (`nmt.data.readers`). `hub`
    holds kwargs for `datasets.load_dataset`, tried only when the local files are absent, and read
    in `datasets`' streaming mode.
    """

    def __init__(self, path: str | None, src_lang: str, tgt_lang: str,
                 splits: Mapping[str, str] | None = None, files: Mapping[str, Any] | None = None,
                 hub: Mapping[str, Any] | None = None, bad_rows: str = "error") -> None:
        if bad_rows not in BAD_ROWS:
            raise DataError(f"data.source.bad_rows={bad_rows!r}: choose one of {', '.join(BAD_ROWS)}")
        self.path = Path(path).expanduser() if path else None
        self.src_lang, self.tgt_lang, self.bad_rows = src_lang, tgt_lang, bad_rows
        self.splits = {s: s for s in SPLITS} | dict(plain(splits) or {})
        self.files = dict(plain(files) or {}) or None
        self.hub = dict(plain(hub) or {}) or None
        self.needed = SPLITS  # the splits read (a zero-shot direction of nmt.data.multilingual: test only)
        self.lang_keys = "data.src_lang / data.tgt_lang"  # what a missing language tells the user to set
        self._plan: dict[str, tuple[str, ...]] | None = None  # split -> (reader, *paths); None: the hub
        self._tried: list[str] = []
        self._hub_data: Any = None

    def describe(self) -> dict[str, Any]:
        """The corpus without reading it: each local file's path, size and modification time, or
        the hub dataset's arguments; raises `DataError` (saying what to set) when there is none."""
        if self.path is not None or self.files:
            try:
                self._plan = self._local_plan()
                skip = {"bad_rows": "skip"} if self.bad_rows == "skip" else {}  # pairs that "error" refuses
                return {"type": "files", "langs": [self.src_lang, self.tgt_lang], **skip,
                        "files": {s: [plan[0], *(_file_stamp(Path(p)) for p in plan[1:])]
                                  for s, plan in self._plan.items()}}
            except _LocalMissing as e:
                if not self.hub:
                    raise DataError(str(e)) from None
                self._tried = [f"local files: {e}"]
        if not self.hub:
            raise DataError("no data: set data.source.path (a folder of <split>.<lang> files), "
                            "data.source.files or data.source.hub")
        return {"type": "hub", "hub": self.hub, "splits": self.splits, "langs": [self.src_lang, self.tgt_lang]}

    def pairs(self, split: str, chunk: int = CHUNK) -> Iterator[Pairs]:
        """The raw pairs of `split`, `chunk` at a time (call `describe` first)."""
        if self._plan is None:
            yield from self._hub_pairs(split, chunk)
            return
        reader, *paths = self._plan[split]
        log.info("reading %s from %s", split, ", ".join(paths))
        if reader == "parallel":
            yield from iter_parallel(Path(paths[0]), Path(paths[1]), chunk)
        elif reader == "tsv":
            yield from iter_tsv(Path(paths[0]), chunk, self.bad_rows)
        else:
            yield from iter_jsonl(Path(paths[0]), self.src_lang, self.tgt_lang, chunk, self.bad_rows)

    def load(self) -> datasets.DatasetDict:
        return in_memory(self)

    # -- local -------------------------------------------------------------------------
    def _local_plan(self) -> dict[str, tuple[str, ...]]:
        if self.files:
            return {s: self._split_files(s) for s in self.needed}
        assert self.path is not None
        if not self.path.is_dir():
            raise _LocalMissing(f"data folder {self.path} does not exist; set data.source.path "
                                "or NMT_DATA_DIR (the folder that holds the corpus folders)")
        plan = {}
        for split in self.needed:
            stem = self.splits[split]
            paths = []
            for lang in (self.src_lang, self.tgt_lang):
                p = self.path / f"{stem}.{lang}"
                p = p if p.is_file() or not p.with_name(p.name + ".gz").is_file() else p.with_name(p.name + ".gz")
                if not p.is_file():
                    self._explain_missing(p, stem, lang, split)
                paths.append(str(p))
            plan[split] = ("parallel", *paths)
        return plan

    def _explain_missing(self, path: Path, stem: str, lang: str, split: str) -> None:
        if path.is_symlink():  # there, but not a file: a link that loops or points to nothing
            try:
                path.stat()
            except OSError as e:
                raise DataError(f"{path}: a symbolic link that cannot be followed ({e.strerror}); fix the link or put "
                                "the file in its place") from None
        if path.exists():
            raise DataError(f"{path} is not a regular file; put the {lang!r} side of the {split!r} split there")
        stems: dict[str, set[str]] = {}
        for f in self.path.iterdir() if self.path else []:
            name, _, ext = f.name.removesuffix(".gz").rpartition(".")
            if f.is_file() and name and ext not in NOT_LANGUAGES:
                stems.setdefault(name, set()).add(ext)
        if stem not in stems:
            raise DataError(f"no files for split {split!r} (stem {stem!r}) in {self.path}; "
                            f"available stems: {', '.join(sorted(stems)) or 'none'}. Set "
                            f"data.source.splits.{split}=<stem>")
        raise DataError(f"{path} not found: language {lang!r} is not in {self.path}; available "
                        f"languages: {', '.join(sorted(stems[stem]))}. Set {self.lang_keys}")

    def _resolve(self, p: str) -> Path:
        path = Path(p).expanduser()
        return path if path.is_absolute() or self.path is None else self.path / path

    def _split_files(self, split: str) -> tuple[str, ...]:
        spec = self.files.get(split) if self.files else None
        if spec is None:
            raise DataError(f"data.source.files has no entry for split {split!r} "
                            f"(has: {', '.join(self.files or {})})")
        if isinstance(spec, Mapping):
            paths = {side: self._resolve(spec[side]) for side in ("src", "tgt")}
            missing = [(side, p) for side, p in paths.items() if not p.is_file()]
            if missing:
                side, p = missing[0]
                raise _LocalMissing(f"{p} not found; set data.source.files.{split}.{side}")
            return ("parallel", str(paths["src"]), str(paths["tgt"]))
        path = self._resolve(str(spec))
        if not path.is_file():
            raise _LocalMissing(f"{path} not found; set data.source.files.{split}")
        kind = Path(path.name.removesuffix(".gz")).suffix
        if kind not in (".tsv", ".jsonl"):
            raise DataError(f"{path}: a single file per split must be .tsv or .jsonl; use "
                            f"{{src: ..., tgt: ...}} for a pair of text files")
        return (kind[1:], str(path))

    # -- hub ---------------------------------------------------------------------------
    def _hub_id(self) -> str:
        assert self.hub is not None
        return "/".join(str(self.hub[k]) for k in ("path", "name") if self.hub.get(k))

    def _hub_pairs(self, split: str, chunk: int) -> Iterator[Pairs]:
        """Rows of the hub split in streaming mode, as (src, tgt) chunks; errors list every attempt."""
        try:
            data = self._hub_split(split)
            rows = iter(data.iter(batch_size=chunk))
            first = next(rows, None)
        except DataError as e:
            if not self._tried:
                raise
            self._fail(f"hub: {e}")
        except Exception as e:  # network, auth, unknown dataset: report every attempt at once
            self._fail(f"hub dataset {self._hub_id()}: {type(e).__name__}: {e}")
        for batch in itertools.chain([first] if first is not None else [], rows):
            yield self._to_src_tgt(batch)

    def _fail(self, attempt: str) -> None:
        tried = [*self._tried, attempt]
        raise DataError("could not load the corpus. Tried:\n  - " + "\n  - ".join(tried) +
                        "\nPoint at local files with data.source.path=/path/to/folder (files "
                        f"<split>.{self.src_lang} / <split>.{self.tgt_lang}), or set NMT_DATA_DIR "
                        "to the folder that holds the corpus folders.")

    def _hub_split(self, split: str) -> Any:
        assert self.hub is not None
        if self._hub_data is None:
            log.info("streaming hub dataset %s", self._hub_id())
            self._hub_data = datasets.load_dataset(**({"streaming": True} | self.hub))
        raw = self._hub_data
        names = (split, self.splits[split], *HUB_SPLIT_ALIASES[split])
        name = next((n for n in names if n in raw), None)
        if name is None:
            raise DataError(f"hub dataset {self._hub_id()} has no split for {split!r} "
                            f"(looked for {', '.join(dict.fromkeys(names))}); it has: "
                            f"{', '.join(raw)}. Set data.source.splits.{split}")
        return raw[name]

    def _to_src_tgt(self, batch: Mapping[str, list[Any]]) -> Pairs:
        """A `translation` column of {lang: text} dicts, or per-language columns, as (src, tgt)."""
        cols, langs = list(batch), (self.src_lang, self.tgt_lang)
        if "translation" in cols:
            rows = batch["translation"]
            fields = list(rows[0]) if rows else []
            if not all(lang in fields for lang in langs):
                raise DataError(f"hub dataset {self._hub_id()}: languages {list(langs)} not all "
                                f"in its translation column; available: {', '.join(fields)}")
            return [r[self.src_lang] or "" for r in rows], [r[self.tgt_lang] or "" for r in rows]
        for a, b in (langs, ("src", "tgt")):
            if a in cols and b in cols:
                return [x or "" for x in batch[a]], [x or "" for x in batch[b]]
        raise DataError(f"hub dataset {self._hub_id()}: no 'translation' column and no columns "
                        f"{list(langs)}; columns are: {', '.join(cols)}")

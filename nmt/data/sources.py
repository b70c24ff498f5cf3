"""Where sentence pairs come from: every source returns a `datasets.DatasetDict`.

Each source has `load() -> DatasetDict` with splits `train`, `valid`, `test` and string
columns `src`, `tgt`; validation, tokenization and filtering happen once, downstream, in
`TranslationDataModule`. Local files are read here in Python (not with `load_dataset("text")`)
so that every problem names the file and line; a Hugging Face hub dataset is the fallback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
from omegaconf import DictConfig, ListConfig, OmegaConf

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
# Line-aligned provenance or documentation next to the text: never a language.
NOT_LANGUAGES = {"session", "origin", "attribution", "md", "txt", "json", "yaml", "yml", "py",
                 "sh", "gz", "zip", "tar", "tsv", "jsonl", "csv", "log"}
HUB_SPLIT_ALIASES = {"valid": ("validation", "dev", "val"), "test": ("test",), "train": ("train",)}


def plain(obj: Any) -> Any:
    """A DictConfig/ListConfig as plain dicts and lists; anything else unchanged."""
    return OmegaConf.to_container(obj, resolve=True) if isinstance(obj, (DictConfig, ListConfig)) else obj


class DataError(Exception):
    """A corpus cannot be loaded or is malformed; the message says what to fix."""


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


def drop_empty(src: list[str], tgt: list[str], split: str = "") -> tuple[list[str], list[str], int]:
    """Strip both sides and drop pairs with a blank side; returns (src, tgt, number dropped)."""
    if len(src) != len(tgt):
        raise DataError(f"split {split!r}: {len(src)} source vs {len(tgt)} target sentences")
    pairs = [(s.strip(), t.strip()) for s, t in zip(src, tgt)]
    kept = [(s, t) for s, t in pairs if s and t]
    dropped = len(pairs) - len(kept)
    if dropped:
        log.warning("%s: dropped %d of %d pairs with an empty side", split, dropped, len(pairs))
    return [s for s, _ in kept], [t for _, t in kept], dropped


def read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file, stripped; invalid UTF-8 raises `DataError` naming the line."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(
            f"{path}, line {line}: invalid UTF-8 (byte 0x{data[e.start]:02x} at byte column "
            f"{column}). Convert the file to UTF-8, e.g. `iconv -f latin1 -t utf-8`."
        ) from None
    lines = text.removeprefix("\ufeff").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.strip() for line in lines]


def read_parallel(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    """Two line-aligned files; different line counts raise `DataError` naming both."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(f"misaligned parallel files: {src_path} has {len(src)} lines but "
                        f"{tgt_path} has {len(tgt)} lines; line i of one must translate line i "
                        "of the other")
    return src, tgt


def read_tsv(path: Path) -> tuple[list[str], list[str]]:
    """A two-column (source TAB target) file."""
    src, tgt = [], []
    for i, line in enumerate(read_lines(path), start=1):
        cols = line.split("\t") if line else ["", ""]
        if len(cols) < 2:
            raise DataError(f"{path}, line {i}: expected 2 tab-separated columns, found {len(cols)}")
        src.append(cols[0])
        tgt.append(cols[1])
    return src, tgt


def read_jsonl(path: Path, src_lang: str, tgt_lang: str) -> tuple[list[str], list[str]]:
    """One JSON object a line: {src_lang: .., tgt_lang: ..} or {"translation": {...}}."""
    src, tgt = [], []
    for i, line in enumerate(read_lines(path), start=1):
        if not line:
            continue
        try:
            obj = json.loads(line)
            pair = obj.get("translation", obj)
            s, t = pair[src_lang], pair[tgt_lang]
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as e:
            raise DataError(f"{path}, line {i}: expected a JSON object with keys {src_lang!r} "
                            f"and {tgt_lang!r} (or under 'translation'): {e!r}") from None
        src.append(s)
        tgt.append(t)
    return src, tgt


class SyntheticSource:
    """Pairs from the project's synthetic-language generator (`nmt.data.synthetic`).

    The same pairs as the files `synthetic.write_corpus(dir, {train: .., valid: .., test: ..},
    seed, lengths=...)` writes: split i is generated with seed `seed * 1000 + i`. Train and valid
    lengths follow `lengths`, the test split `test_lengths` (default uniform, so that every
    source-length bucket of the test report holds about as many sentences).
    """

    def __init__(self, num_pairs: int = 50000, valid_pairs: int = 500, test_pairs: int = 1000,
                 seed: int = 0, min_len: int = 3, max_len: int = 60, lengths: str = "natural",
                 test_lengths: str = "uniform", median_len: float = 15) -> None:
        from nmt.data.synthetic import LENGTHS

        for key, value in (("lengths", lengths), ("test_lengths", test_lengths)):
            if value not in LENGTHS:
                raise DataError(f"data.source.{key}={value!r}: choose one of {', '.join(LENGTHS)}")
        self.sizes = {"train": num_pairs, "valid": valid_pairs, "test": test_pairs}
        self.lengths = {"train": lengths, "valid": lengths, "test": test_lengths}
        self.seed, self.min_len, self.max_len, self.median_len = seed, min_len, max_len, median_len

    def load(self) -> datasets.DatasetDict:
        from nmt.data.synthetic import generate_pairs

        out = {}
        for i, split in enumerate(SPLITS):  # one seed per split: sizes change nothing else
            pairs = generate_pairs(self.sizes[split], seed=self.seed * 1000 + i, min_len=self.min_len,
                                   max_len=self.max_len, lengths=self.lengths[split], median_len=self.median_len)
            out[split] = make_dataset([s for s, _ in pairs], [t for _, t in pairs])
        return datasets.DatasetDict(out)


class FileSource:
    """A parallel corpus in a folder (`<stem>.<lang>` files), explicit files, or on the hub.

    `splits` maps split -> file stem (Multi30k: valid -> val, test -> test_2016_flickr).
    `files` gives explicit per-split files instead: {train: {src: a.de, tgt: a.en}} or
    {train: train.tsv | train.jsonl}, relative to `path` when set. `hub` holds kwargs for
    `datasets.load_dataset`, tried only when the local files are absent.
    """

    def __init__(self, path: str | None, src_lang: str, tgt_lang: str,
                 splits: Mapping[str, str] | None = None, files: Mapping[str, Any] | None = None,
                 hub: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path).expanduser() if path else None
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.splits = {s: s for s in SPLITS} | dict(plain(splits) or {})
        self.files = dict(plain(files) or {}) or None
        self.hub = dict(plain(hub) or {}) or None

    def load(self) -> datasets.DatasetDict:
        tried = []
        if self.path is not None or self.files:
            try:
                return self._load_local()
            except _LocalMissing as e:
                if not self.hub:
                    raise DataError(str(e)) from None
                tried.append(f"local files: {e}")
        if not self.hub:
            raise DataError("no data: set data.source.path (a folder of <split>.<lang> files), "
                            "data.source.files or data.source.hub")
        try:
            return self._load_hub()
        except DataError as e:
            if not tried:
                raise
            tried.append(f"hub: {e}")
        except Exception as e:  # network, auth, unknown dataset: report every attempt at once
            tried.append(f"hub dataset {self._hub_id()}: {type(e).__name__}: {e}")
        raise DataError("could not load the corpus. Tried:\n  - " + "\n  - ".join(tried) +
                        "\nPoint at local files with data.source.path=/path/to/folder (files "
                        f"<split>.{self.src_lang} / <split>.{self.tgt_lang}), or set NMT_DATA_DIR "
                        "to the folder that holds the corpus folders.")

    # -- local -------------------------------------------------------------------------
    def _load_local(self) -> datasets.DatasetDict:
        if self.files:
            return datasets.DatasetDict({s: self._load_split_files(s) for s in SPLITS})
        assert self.path is not None
        if not self.path.is_dir():
            raise _LocalMissing(f"data folder {self.path} does not exist; set data.source.path "
                                "or NMT_DATA_DIR (the folder that holds the corpus folders)")
        out = {}
        for split in SPLITS:
            stem = self.splits[split]
            paths = [self.path / f"{stem}.{lang}" for lang in (self.src_lang, self.tgt_lang)]
            for p, lang in zip(paths, (self.src_lang, self.tgt_lang)):
                if not p.is_file():
                    self._explain_missing(p, stem, lang, split)
            out[split] = make_dataset(*read_parallel(*paths))
            log.info("read %s: %d pairs from %s.{%s,%s}", split, len(out[split]),
                     self.path / stem, self.src_lang, self.tgt_lang)
        return datasets.DatasetDict(out)

    def _explain_missing(self, path: Path, stem: str, lang: str, split: str) -> None:
        stems: dict[str, set[str]] = {}
        for f in self.path.iterdir() if self.path else []:
            name, _, ext = f.name.rpartition(".")
            if f.is_file() and name and ext not in NOT_LANGUAGES:
                stems.setdefault(name, set()).add(ext)
        if stem not in stems:
            raise DataError(f"no files for split {split!r} (stem {stem!r}) in {self.path}; "
                            f"available stems: {', '.join(sorted(stems)) or 'none'}. Set "
                            f"data.source.splits.{split}=<stem>")
        raise DataError(f"{path} not found: language {lang!r} is not in {self.path}; available "
                        f"languages: {', '.join(sorted(stems[stem]))}. Set data.src_lang / "
                        "data.tgt_lang")

    def _resolve(self, p: str) -> Path:
        path = Path(p).expanduser()
        return path if path.is_absolute() or self.path is None else self.path / path

    def _load_split_files(self, split: str) -> datasets.Dataset:
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
            src, tgt = read_parallel(paths["src"], paths["tgt"])
        else:
            path = self._resolve(str(spec))
            if not path.is_file():
                raise _LocalMissing(f"{path} not found; set data.source.files.{split}")
            if path.suffix == ".tsv":
                src, tgt = read_tsv(path)
            elif path.suffix == ".jsonl":
                src, tgt = read_jsonl(path, self.src_lang, self.tgt_lang)
            else:
                raise DataError(f"{path}: a single file per split must be .tsv or .jsonl; use "
                                f"{{src: ..., tgt: ...}} for a pair of text files")
        log.info("read %s: %d pairs from %s", split, len(src), spec)
        return make_dataset(src, tgt)

    # -- hub ---------------------------------------------------------------------------
    def _hub_id(self) -> str:
        assert self.hub is not None
        return "/".join(str(self.hub[k]) for k in ("path", "name") if self.hub.get(k))

    def _load_hub(self) -> datasets.DatasetDict:
        assert self.hub is not None
        log.info("loading hub dataset %s", self._hub_id())
        raw = datasets.load_dataset(**self.hub)
        out = {}
        for split in SPLITS:
            names = (split, self.splits[split], *HUB_SPLIT_ALIASES[split])
            name = next((n for n in names if n in raw), None)
            if name is None:
                raise DataError(f"hub dataset {self._hub_id()} has no split for {split!r} "
                                f"(looked for {', '.join(dict.fromkeys(names))}); it has: "
                                f"{', '.join(raw)}. Set data.source.splits.{split}")
            out[split] = self._to_src_tgt(raw[name].with_format("arrow")[:])
        return datasets.DatasetDict(out)

    def _to_src_tgt(self, table: pa.Table) -> datasets.Dataset:
        """Map a `translation` struct column, or per-language columns, to `src`/`tgt`."""
        cols, langs = table.column_names, (self.src_lang, self.tgt_lang)
        if "translation" in cols:
            trans = table.column("translation").combine_chunks()
            fields = [trans.type.field(i).name for i in range(trans.type.num_fields)]
            if not all(lang in fields for lang in langs):
                raise DataError(f"hub dataset {self._hub_id()}: languages {list(langs)} not all "
                                f"in its translation column; available: {', '.join(fields)}")
            return datasets.Dataset(pa.table({"src": trans.field(self.src_lang),
                                              "tgt": trans.field(self.tgt_lang)}))
        for a, b in (langs, ("src", "tgt")):
            if a in cols and b in cols:
                return datasets.Dataset(pa.table({"src": table.column(a), "tgt": table.column(b)}))
        raise DataError(f"hub dataset {self._hub_id()}: no 'translation' column and no columns "
                        f"{list(langs)}; columns are: {', '.join(cols)}")

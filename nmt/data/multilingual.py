"""Several translation directions in one corpus: target-language tags and temperature sampling.

`MultilingualSource` reads one folder of `<stem>.<lang>` files (Multi30k: train.de, train.en,
train.fr, ...) in several directions, `[de-en, en-de, en-fr, fr-en]`, and writes the tag of each
pair's target language as the first word of its source (`<2fr> A man ...`, `nmt.languages.tags`;
Johnson et al. 2017). A tag on the source, rather than a forced first target token, leaves the
decoder, the search and every exported model as they are: the encoder of every architecture
(the plain LSTM's fixed vector included) sees the tag, the references hold no tag to strip, and a
CTranslate2 folder translates tagged text like any other. The data module makes the tags pieces
of their own in the joint SentencePiece vocabulary.

Each pair keeps the direction it came from (its *origin*, an index into `origins`): the data
module samples training pairs by direction with a temperature (`temperature_items`), and
`nmt-evaluate` reports each direction on its own. `zero_shot` directions are test-only: their
test pairs are tagged like the others, and no training or validation pair pairs those languages.

`target_language: decoder_prefix` writes the languages as M2M100, NLLB-200 and mBART-50 read them
(`nmt.checkpoints.m2m100`), for fine-tuning such an imported model with its own codes: the source
starts with the tag of its own language (`<2de> Ein Hund`) and the target with the tag of the
target language (`<2fr> Un chien`), whose piece is the decoder's first token. The references and
hypotheses are scored without it (`target_prefixed`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from nmt.data.readers import CHUNK, DataError
from nmt.data.sources import SPLITS, FileSource, plain
from nmt.languages.tags import split_tag, tag

MAX_DIRECTIONS = 1000  # directions of one source (a config from a file must not ask for millions)
# Where a pair's target language is written: a tag starting the source (Johnson et al. 2017), or the
# source language's tag on the source and the target language's starting the target (M2M100's codes).
TARGET_LANGUAGE = ("source_tag", "decoder_prefix")
Origins = tuple[list[str], list[str], np.ndarray]  # (sources, targets, origin of each pair) of one chunk


def parse_direction(text: Any, where: str) -> tuple[str, str]:
    """``"de-en"`` -> ``("de", "en")``; a DataError naming ``where`` otherwise."""
    parts = text.split("-") if isinstance(text, str) else []
    if len(parts) != 2:
        raise DataError(f"{where}={str(text)[:40]!r}: write a direction as <source>-<target>, e.g. de-en")
    try:
        for lang in parts:
            tag(lang)
    except ValueError as e:
        raise DataError(f"{where}={text!r}: {e}") from None
    if parts[0] == parts[1]:
        raise DataError(f"{where}={text!r}: the source and target languages are the same")
    return parts[0], parts[1]


class MultilingualSource:
    """Pairs of several directions of one folder, the source tagged with its target language.

    directions: the trained directions, e.g. [de-en, en-de, en-fr, fr-en] (train, valid and test).
    zero_shot: directions tested only (their test pairs; e.g. [de-fr]), none of them trained.
    splits: split -> file stem, as `FileSource` (Multi30k: valid -> val, test -> test_2016_flickr).
    folders: a direction's own folder, {en-fr: /data/europarl-en-fr}, for corpora of several
        sources; the others are read from `path`.
    target_language: `source_tag` (the target language's tag starts the source) or
        `decoder_prefix` (the source language's tag starts the source, the target language's the
        target: an imported M2M100, NLLB-200 or mBART-50 model's convention).
    A direction whose files are missing, or with no pair in a split, is an error naming it.
    """

    def __init__(self, path: str, directions: list[str], zero_shot: list[str] | None = None,
                 splits: Mapping[str, str] | None = None, folders: Mapping[str, str] | None = None,
                 target_language: str = "source_tag") -> None:
        if target_language not in TARGET_LANGUAGE:
            raise DataError(f"data.source.target_language={str(target_language)[:40]}: choose "
                            f"{' or '.join(TARGET_LANGUAGE)}")
        self.target_prefixed = target_language == "decoder_prefix"  # targets start with their language's tag
        directions, zero_shot = plain(directions), plain(zero_shot) or []
        for key, value in (("directions", directions), ("zero_shot", zero_shot)):
            if not isinstance(value, list):
                raise DataError(f"data.source.{key}: a list such as [de-en, en-de], not {str(value)[:40]!r}")
            if len(value) > MAX_DIRECTIONS:
                raise DataError(f"data.source.{key}: {len(value)} directions; at most {MAX_DIRECTIONS}")
        trained = [parse_direction(d, f"data.source.directions[{i}]") for i, d in enumerate(directions)]
        tested = [parse_direction(d, f"data.source.zero_shot[{i}]") for i, d in enumerate(zero_shot)]
        if not trained:
            raise DataError("data.source.directions: give at least one direction, e.g. [de-en, en-de]")
        names = [f"{s}-{t}" for s, t in trained + tested]
        repeated = sorted(n for n, count in Counter(names).items() if count > 1)
        if repeated:
            raise DataError(f"data.source: the direction(s) {', '.join(repeated)} are given twice (a direction is "
                            "trained, in directions, or tested only, in zero_shot)")
        sources, targets = {s for s, _ in trained}, {t for _, t in trained}
        for i, (s, t) in enumerate(tested):
            if s not in sources or t not in targets:
                side, lang = ("from", s) if s not in sources else ("into", t)
                raise DataError(f"data.source.zero_shot[{i}]={s}-{t}: no trained direction translates {side} {lang}; "
                                "zero-shot pairs languages the model learns in other directions")
        self.origins = names  # origin i of a pair: its direction
        self.zero_shot = names[len(trained):]
        self.tags = sorted({tag(lang) for pair in trained + tested for lang in (pair if self.target_prefixed else pair[1:])})
        folders = plain(folders) or {}
        if not isinstance(folders, Mapping):
            raise DataError(f"data.source.folders: a mapping such as {{en-fr: /data/en-fr}}, not {str(folders)[:40]!r}")
        if unknown := sorted(set(folders) - set(names)):
            raise DataError(f"data.source.folders: {', '.join(map(str, unknown))} is not one of the directions "
                            f"({', '.join(names)})")
        self._files = [FileSource(str(folders.get(name, path)), *pair, splits=splits)
                       for name, pair in zip(names, trained + tested)]
        for i, source in enumerate(self._files):
            source.needed, source.lang_keys = self._splits_of(i), \
                "directions of the languages the folder has, or the direction's own folder (data.source.folders)"

    def _where(self, i: int) -> str:
        k = i - (len(self.origins) - len(self.zero_shot))
        return f"data.source.zero_shot[{k}]={self.origins[i]}" if k >= 0 else \
            f"data.source.directions[{i}]={self.origins[i]}"

    def _splits_of(self, i: int) -> tuple[str, ...]:
        return ("test",) if self.origins[i] in self.zero_shot else SPLITS

    def describe(self) -> dict[str, Any]:
        """Each direction's files (`FileSource.describe`), by direction."""
        files = {}
        for i, source in enumerate(self._files):
            try:
                found = source.describe()
            except DataError as e:
                raise DataError(f"{self._where(i)}: {e}") from None
            if found.get("type") != "files":
                raise DataError(f"{self._where(i)}: no local files in {source.path}")
            files[self.origins[i]] = {s: found["files"][s] for s in self._splits_of(i)}
        return {"type": "multilingual", "origins": self.origins,
                "tag": "<2src> on the source, <2tgt> on the target" if self.target_prefixed else "<2xx> on the source",
                "zero_shot": self.zero_shot, "files": files}

    def pairs(self, split: str, chunk: int = CHUNK) -> Iterator[Origins]:
        """The pairs of `split`, direction after direction, each chunk with its pairs' origins."""
        for i, source in enumerate(self._files):
            if split not in self._splits_of(i):
                continue
            marker, found = tag(source.src_lang if self.target_prefixed else source.tgt_lang), 0
            for src, tgt in source.pairs(split, chunk):
                found += sum(1 for s, t in zip(src, tgt) if s.strip() and t.strip())
                if self.target_prefixed:
                    tgt = [f"{tag(source.tgt_lang)} {t}" if t.strip() else t for t in tgt]
                yield ([f"{marker} {s}" if s.strip() else s for s in src], tgt,
                       np.full(len(src), i, dtype=np.uint16))
            if not found:
                raise DataError(f"{self._where(i)}: no sentence pairs in split {split!r} "
                                f"({', '.join(source._plan[split][1:]) if source._plan else source.path})")

    def references(self, texts: list[str]) -> list[str]:
        """Target texts as they are scored: without the leading language tag of `decoder_prefix`."""
        return [split_tag(t)[1] for t in texts] if self.target_prefixed else texts

    def load(self) -> Any:
        from nmt.data.sources import in_memory

        return in_memory(self)


def temperature_items(origins: np.ndarray, temperature: float, seed: int, epoch: int) -> np.ndarray:
    """The training pairs (indices into `origins`) of one epoch, sampled by direction with a
    temperature (Arivazhagan et al. 2019): direction d of n_d pairs gets a share
    p_d = n_d^(1/T) / sum_k n_k^(1/T) of the epoch's N = sum n_d pairs. T = 1 keeps the corpus
    proportions, a larger T moves towards equal shares (T = 5 is the paper's choice). A direction
    drawn more often than it has pairs repeats all of them, then draws the rest without
    replacement; one drawn less often draws without replacement, a new draw every epoch.
    Sorted, from (seed, epoch) alone."""
    counts = np.bincount(origins)
    present = np.flatnonzero(counts)
    weights = counts[present].astype(np.float64) ** (1.0 / temperature)
    shares = np.round(len(origins) * weights / weights.sum()).astype(np.int64)
    rng = np.random.default_rng([seed, epoch, 7])  # 7: a stream of its own beside the batch order's
    parts = []
    for d, m in zip(present.tolist(), shares.tolist()):
        rows = np.flatnonzero(origins == d)
        copies, rest = divmod(m, len(rows))
        parts += [rows] * copies + [np.sort(rng.choice(rows, rest, replace=False))]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def sampling_changes(origins: np.ndarray, temperature: float) -> bool:
    """Whether `temperature_items` differs from taking every pair once (equal-sized directions:
    every temperature gives each its own size)."""
    counts = np.bincount(origins)
    counts = counts[counts > 0].astype(np.float64)
    weights = counts ** (1.0 / temperature)
    return not np.array_equal(np.round(len(origins) * weights / weights.sum()), counts)

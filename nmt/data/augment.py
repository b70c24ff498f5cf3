"""Robustness augmentation of training pairs, on the fly: upper-casing, title-casing and
character noise, each applied to a drawn fraction of the pairs of every epoch.

Configured as a list (``data.augment``), each entry a modifier name and its ``rate``, the
fraction of training pairs it changes (drawn anew each epoch; a pair may get several, applied
in list order):

- ``upper``: the pair in capitals, source and target (ALL-CAPS input gets ALL-CAPS output).
- ``title``: every word's first letter a capital, on both sides.
- ``noise``: typing errors in the source only, the target left clean (the model learns to read
  through them): ``chars`` of the characters (at least one) each deleted, repeated, swapped with
  the next or replaced by another character of the same sentence (no new symbols, so no new
  unknown pieces).

Which pairs an epoch changes and how depends only on (``seed``, epoch, pair), never on the
DataLoader workers or the number of DDP ranks, so a resumed run sees the same pairs. The
modifiers follow OpusTrainer's UpperCase, TitleCase and Typos (Bogoychev et al. 2023).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from nmt.data.batching import TokenizedSplit
from nmt.data.prepare import TextColumn
from nmt.data.tokenizer import Tokenizer

KEY = "data.augment"
_EPOCH_STREAM, _PAIR_STREAM = 7, 8  # fixed words of the seeds: the draws differ from the sampler's and each other's


def upper(src: str, tgt: str, rng: np.random.Generator, **_: Any) -> tuple[str, str]:
    return src.upper(), tgt.upper()


def title(src: str, tgt: str, rng: np.random.Generator, **_: Any) -> tuple[str, str]:
    def words(text: str) -> str:
        return " ".join(w[:1].upper() + w[1:] for w in text.split(" "))

    return words(src), words(tgt)


def noise(src: str, tgt: str, rng: np.random.Generator, chars: float = 0.05, **_: Any) -> tuple[str, str]:
    return typos(src, rng, chars), tgt


def typos(text: str, rng: np.random.Generator, chars: float) -> str:
    """``text`` with round(``chars`` x its non-space characters), at least one, edited: each
    deleted, doubled, swapped with the next one or replaced by another character of ``text``."""
    letters = [i for i, c in enumerate(text) if not c.isspace()]
    if not letters:
        return text
    out = list(text)
    edits = rng.choice(letters, size=min(len(letters), max(1, round(chars * len(letters)))), replace=False)
    alphabet = sorted({c for c in text if not c.isspace()})
    for i in sorted(edits.tolist(), reverse=True):  # right to left: earlier positions stay put
        kind = int(rng.integers(4))
        if kind == 0:
            out[i] = ""
        elif kind == 1:
            out[i] = out[i] * 2
        elif kind == 2 and i + 1 < len(out):
            out[i], out[i + 1] = out[i + 1], out[i]
        else:
            out[i] = alphabet[int(rng.integers(len(alphabet)))]
    return "".join(out)


MODIFIERS = {"upper": upper, "title": title, "noise": noise}
OPTIONS = {"upper": set(), "title": set(), "noise": {"chars"}}  # each modifier's options beside name and rate


@dataclass(frozen=True)
class Modifier:
    name: str
    rate: float
    options: Mapping[str, Any]

    def __call__(self, src: str, tgt: str, rng: np.random.Generator) -> tuple[str, str]:
        return MODIFIERS[self.name](src, tgt, rng, **self.options)


def modifiers(specs: Sequence[Mapping[str, Any]] | None, key: str = KEY) -> list[Modifier]:
    """The modifiers of ``specs`` (``[{name: upper, rate: 0.05}, ...]``); a bad entry raises a
    one-line ValueError naming ``key[i]`` and the field."""
    out = []
    for i, spec in enumerate(specs or []):
        where = f"{key}[{i}]"
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where}: a mapping such as {{name: upper, rate: 0.05}}, got {spec!r}")
        name = spec.get("name")
        if name not in MODIFIERS:
            raise ValueError(f"{where}.name={name!r}: choose one of {', '.join(MODIFIERS)}")
        unknown = sorted(set(spec) - {"name", "rate"} - OPTIONS[name])
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown} for {name} (it takes rate"
                             f"{''.join(', ' + o for o in sorted(OPTIONS[name]))})")
        rate = spec.get("rate")
        if not _fraction(rate):
            raise ValueError(f"{where}.rate={rate!r}: the fraction of training pairs to change, a number in [0, 1]")
        options = {k: spec[k] for k in OPTIONS[name] if k in spec}
        if "chars" in options and not (_fraction(options["chars"]) and options["chars"] > 0):
            raise ValueError(f"{where}.chars={options['chars']!r}: the fraction of characters to edit, in (0, 1]")
        out.append(Modifier(str(name), float(rate), options))
    return out


def _fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


class Augmentation:
    """The modifiers of one run and its seed: which pairs an epoch changes, and how."""

    def __init__(self, specs: Sequence[Mapping[str, Any]] | None, seed: int) -> None:
        self.modifiers = modifiers(specs)
        self.seed = int(seed)
        self._chosen: tuple[int, int, np.ndarray] | None = None  # (epoch, pairs, masks) of the last call

    def __bool__(self) -> bool:
        return any(m.rate > 0 for m in self.modifiers)

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": m.name, "rate": m.rate, **m.options} for m in self.modifiers]

    def chosen(self, epoch: int, pairs: int) -> np.ndarray:
        """(modifiers, pairs) bools: which modifier changes which pair in ``epoch``."""
        if self._chosen is None or self._chosen[:2] != (epoch, pairs):
            rng = np.random.default_rng([self.seed, _EPOCH_STREAM, epoch])  # 3 words: never a pair's 4
            masks = np.stack([rng.random(pairs) < m.rate for m in self.modifiers]) if self.modifiers \
                else np.zeros((0, pairs), dtype=bool)
            self._chosen = (epoch, pairs, masks)
        return self._chosen[2]

    def changed(self, epoch: int, pairs: int) -> np.ndarray:
        """Indices of the pairs ``epoch`` changes."""
        return np.flatnonzero(self.chosen(epoch, pairs).any(0))

    def apply(self, src: str, tgt: str, epoch: int, pair: int, pairs: int) -> tuple[str, str]:
        """Pair number ``pair`` (of ``pairs``) as ``epoch`` trains on it."""
        which = self.chosen(epoch, pairs)[:, pair]
        if not which.any():
            return src, tgt
        rng = np.random.default_rng([self.seed, _PAIR_STREAM, epoch, pair])
        for modifier, on in zip(self.modifiers, which):
            if on:
                src, tgt = modifier(src, tgt, rng)
        return src, tgt


def augmented_copy(name: str, sources: Sequence[str], refs: Sequence[str], seed: int = 0,
                   **options: Any) -> tuple[list[str], list[str]]:
    """A test set with modifier ``name`` applied to every pair (``upper``: both sides in capitals;
    ``noise``: typing errors in the sources, the references clean), drawn with ``seed``."""
    (modifier,) = modifiers([{"name": name, "rate": 1.0, **options}], key="augmented_copy")
    out = [modifier(s, r, np.random.default_rng([seed, i])) for i, (s, r) in enumerate(zip(sources, refs))]
    return [s for s, _ in out], [r for _, r in out]


class AugmentedSplit(Dataset):
    """The training split as ``augmentation`` changes it: an epoch's changed pairs are read as text,
    modified and encoded again (truncated to the split's limits); the others are ``base``'s items.
    ``lengths_of_epoch`` gives the token batch sampler each epoch's real lengths, so a batch of
    changed pairs (capitals split into more pieces) stays within its token budget. Items come
    from ``__getitems__`` of a ``Batch`` (it carries its epoch); without one, unchanged."""

    def __init__(self, base: TokenizedSplit, texts: tuple[TextColumn, TextColumn],
                 vocab: tuple[Tokenizer, Tokenizer], augmentation: Augmentation) -> None:
        self.base, self.texts, self.vocab, self.augmentation = base, texts, vocab, augmentation

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[int, np.ndarray, np.ndarray | None]:
        return self.base[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[int, np.ndarray, np.ndarray | None]]:
        epoch = getattr(indices, "epoch", None)
        if epoch is None:
            return [self.base[i] for i in indices]
        indices = list(indices)
        which = self.augmentation.chosen(epoch, len(self))[:, indices].any(0)  # a lookup: O(batch), not O(corpus)
        changed = sorted({i for i, on in zip(indices, which.tolist()) if on})
        encoded = dict(zip(changed, self._encoded(epoch, changed)))
        return [(i, *encoded[i]) if i in encoded else self.base[i] for i in indices]

    def _encoded(self, epoch: int, pairs: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        rows = self.base.index[np.asarray(pairs, dtype=np.int64)] if len(pairs) else np.zeros(0, np.int64)
        texts = [column.take(rows) for column in self.texts]
        changed = [self.augmentation.apply(s, t, epoch, i, len(self)) for i, s, t in zip(pairs, *texts)]
        limits = (self.base.max_src_len, self.base.max_tgt_len)
        sides = [vocab.encode_batch([pair[k] for pair in changed]) for k, vocab in enumerate(self.vocab)]
        return [tuple(np.asarray(ids[:limit] if limit is not None else ids, dtype=np.int64)
                      for ids, limit in zip(pair, limits)) for pair in zip(*sides)]  # type: ignore[misc]

    def lengths_of_epoch(self, epoch: int) -> np.ndarray:
        """(N, 2) lengths with BOS/EOS of the pairs as ``epoch`` trains on them."""
        lengths = self.base.lengths().copy()
        pairs = self.augmentation.changed(epoch, len(self))
        for start in range(0, len(pairs), 20_000):  # bounded memory for the text of a large corpus
            chunk = pairs[start : start + 20_000]
            for i, (src, tgt) in zip(chunk.tolist(), self._encoded(epoch, chunk.tolist())):
                lengths[i] = (len(src) + 1, len(tgt) + 1)
        return lengths

"""Subword regularization: each training sentence segmented anew every epoch.

- unigram models: a segmentation sampled from the model (Kudo 2018), among the ``nbest_size`` best
  (-1: from the whole lattice), with probabilities sharpened or flattened by ``alpha``;
- BPE models: BPE-dropout (Provilkov et al. 2020), each merge skipped with probability ``dropout``.

Configured as ``data.subword_sampling`` (``enabled``, ``alpha``, ``nbest_size``, ``dropout``,
``length_margin``); the tokenizer's model type decides which keys apply, and a key of the other
type is a one-line error naming it. Validation, test and translation read the stored
deterministic ids.

The sample of a sentence depends only on (``seed``, epoch, pair, side): SentencePiece's sampler
draws from one generator per process, which is seeded before each sentence, so DataLoader
workers, DDP ranks and a resumed run see the same pieces.

Batches are planned on the deterministic lengths, each side stretched by ``length_margin``
(``planned``); a sampled side longer than its batch's planned width is replaced by the
deterministic one (which is never longer), so a batch never holds more padded tokens than
``data.max_tokens`` allowed for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import sentencepiece as spm
from torch.utils.data import Dataset

from nmt.data.batching import TokenizedSplit
from nmt.data.prepare import TextColumn
from nmt.data.tokenizer import Tokenizer

KEY = "data.subword_sampling"
_STREAM = 11  # a fixed word of the seeds: the draws differ from the batch sampler's and the augmentation's
KEYS = {"unigram": ("alpha", "nbest_size"), "bpe": ("dropout",)}
DEFAULTS = {"alpha": 0.1, "nbest_size": 64, "dropout": 0.1}  # Kudo (2018): l=64, alpha=0.1; Provilkov et al. (2020): p=0.1
_MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}  # sentencepiece_model.proto, TrainerSpec.ModelType


def model_type(tokenizer: Tokenizer) -> str:
    """The model type a SentencePiece model was trained as (TrainerSpec field 3 of ModelProto
    field 2), read from the serialized model without protobuf."""
    def fields(data: bytes):
        i = 0
        while i < len(data):
            key, i = _varint(data, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, i = _varint(data, i)
            elif wire == 2:
                size, i = _varint(data, i)
                value, i = data[i : i + size], i + size
            elif wire in (1, 5):
                value, i = None, i + (8 if wire == 1 else 4)
            else:
                return
            yield number, value

    spec = next((v for n, v in fields(tokenizer.sp.serialized_model_proto()) if n == 2), b"")
    kind = next((v for n, v in fields(spec) if n == 3), 1)  # absent: the default, UNIGRAM
    return _MODEL_TYPES.get(kind, "unknown")


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            return value, i


@dataclass(frozen=True)
class SubwordSampling:
    """How a run samples segmentations: ``kind`` (unigram | bpe), its parameters, the margin."""

    kind: str
    alpha: float  # unigram: alpha; bpe: the dropout probability (SentencePiece takes both as alpha)
    nbest_size: int
    length_margin: float
    seed: int

    @classmethod
    def from_config(cls, spec: Mapping[str, Any] | None, model_type: str, seed: int,
                    typed: str = "data.tokenizer.model_type") -> SubwordSampling | None:
        """The sampling of ``spec`` for a tokenizer of ``model_type`` (what ``typed`` says), or None
        when off; a bad or mismatched key raises a one-line ValueError naming it."""
        if not spec or not spec.get("enabled"):
            return None
        unknown = sorted(set(spec) - {"enabled", "length_margin", *KEYS["unigram"], *KEYS["bpe"]})
        if unknown:
            raise ValueError(f"{KEY}: unknown key(s) {unknown} (it takes enabled, alpha, nbest_size, dropout, "
                             "length_margin)")
        if model_type not in KEYS:
            raise ValueError(f"{KEY}.enabled=true: {typed}={model_type} has one segmentation per "
                             "sentence; sampling needs a unigram or bpe model")
        other = "bpe" if model_type == "unigram" else "unigram"
        for name in KEYS[other]:
            if spec.get(name) is not None:
                raise ValueError(f"{KEY}.{name}={spec[name]} is for {other} models, and {typed}={model_type}: "
                                 f"set {' or '.join(f'{KEY}.{k}' for k in KEYS[model_type])} instead")
        value = {name: DEFAULTS[name] if spec.get(name) is None else spec[name] for name in KEYS[model_type]}
        if model_type == "unigram":
            alpha, nbest = value["alpha"], value["nbest_size"]
            if not _number(alpha) or alpha <= 0:
                raise ValueError(f"{KEY}.alpha={alpha!r}: a positive number (smaller: flatter, more varied "
                                 "segmentations)")
            if isinstance(nbest, bool) or not isinstance(nbest, int) or not (nbest == -1 or nbest >= 2):
                raise ValueError(f"{KEY}.nbest_size={nbest!r}: how many best segmentations to sample among, "
                                 "at least 2, or -1 for all of them")
        else:
            alpha, nbest = value["dropout"], -1  # SentencePiece asks for one; BPE-dropout ignores it
            if not _number(alpha) or not 0 < alpha < 1:
                raise ValueError(f"{KEY}.dropout={alpha!r}: the probability of skipping a merge, in (0, 1)")
        margin = spec.get("length_margin", 0.2)
        if not _number(margin) or margin < 0:
            raise ValueError(f"{KEY}.length_margin={margin!r}: a fraction (0.2: batches planned for sampled "
                             "segmentations 20% longer than the stored ones), at least 0")
        return cls(model_type, float(alpha), int(nbest), float(margin), int(seed))

    def describe(self) -> dict[str, Any]:
        params = {"alpha": self.alpha, "nbest_size": self.nbest_size} if self.kind == "unigram" \
            else {"dropout": self.alpha}
        return {"kind": self.kind, **params, "length_margin": self.length_margin}

    def sentence_seed(self, epoch: int, pair: int, side: int) -> int:
        return int(np.random.SeedSequence([self.seed, _STREAM, epoch, pair, side]).generate_state(1)[0])

    def sample(self, tokenizer: Tokenizer, text: str, epoch: int, pair: int, side: int) -> list[int]:
        """The ids of ``text`` as epoch ``epoch`` segments pair ``pair``'s side ``side`` (0: source)."""
        spm.set_random_generator_seed(self.sentence_seed(epoch, pair, side))
        return tokenizer.sp.encode(text, out_type=int, enable_sampling=True, alpha=self.alpha,
                                   nbest_size=self.nbest_size)

    def planned(self, lengths: np.ndarray, limits: Sequence[int | None]) -> np.ndarray:
        """Lengths with BOS/EOS (N, 2) the batches are planned on: each side's subwords stretched by
        ``length_margin``, rounded up, at most its limit."""
        subwords = np.asarray(lengths, dtype=np.int64) - 1
        out = np.ceil(subwords * (1 + self.length_margin)).astype(np.int64)
        for k, limit in enumerate(limits[: out.shape[1]]):
            if limit is not None:
                out[:, k] = np.minimum(out[:, k], np.maximum(limit, subwords[:, k]))
        return out + 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class SampledSplit(Dataset):
    """The training split with each pair segmented by ``sampling`` in every epoch.

    inner: what would be read without sampling: the training split (a ``TokenizedSplit``) or its
        augmentation (``nmt.data.augment.AugmentedSplit``, whose changed texts are sampled too).
    texts: the prepared source and target text; vocab: the (source, target) tokenizers.
    Items come from ``__getitems__`` of a ``Batch`` (it carries its epoch); without one, the
    deterministic ids. ``fallbacks`` counts the sampled sides this process replaced by the
    deterministic ones (longer than their batch's planned width).
    """

    def __init__(self, inner: Any, texts: tuple[TextColumn, TextColumn], vocab: tuple[Tokenizer, Tokenizer],
                 sampling: SubwordSampling) -> None:
        self.inner, self.texts, self.vocab, self.sampling = inner, texts, vocab, sampling
        self.base: TokenizedSplit = getattr(inner, "base", inner)
        self.augmentation = getattr(inner, "augmentation", None)
        self.limits = (self.base.max_src_len, self.base.max_tgt_len)
        self.sampled = self.fallbacks = 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[int, np.ndarray, np.ndarray | None]:
        return self.inner[i]

    def lengths(self) -> np.ndarray:
        """(N, 2) planned lengths of the stored pairs (see ``SubwordSampling.planned``)."""
        return self.sampling.planned(self.base.lengths(), self.limits)

    def lengths_of_epoch(self, epoch: int) -> np.ndarray:
        """(N, 2) planned lengths of the pairs as ``epoch`` trains on them (augmented or not)."""
        inner = getattr(self.inner, "lengths_of_epoch", None)
        return self.lengths() if inner is None else self.sampling.planned(inner(epoch), self.limits)

    def __getitems__(self, indices: list[int]) -> list[tuple[int, np.ndarray, np.ndarray | None]]:
        fixed = self.inner.__getitems__(indices)  # the deterministic ids, augmented where the epoch changes them
        epoch = getattr(indices, "epoch", None)
        if epoch is None or not fixed:
            return fixed
        pairs = [i for i, _, _ in fixed]
        stored = np.array([[len(s) + 1, len(t) + 1] for _, s, t in fixed], dtype=np.int64)
        width = int(self.sampling.planned(stored, self.limits).max()) - 1  # the batch's planned subwords a side
        texts = [column.take(self.base.index[np.asarray(pairs, dtype=np.int64)]) for column in self.texts]
        out = []
        for (i, *ids), src, tgt in zip(fixed, *texts):
            if self.augmentation is not None:
                src, tgt = self.augmentation.apply(src, tgt, epoch, i, len(self))
            sides = []
            for side, (text, vocab, limit, kept) in enumerate(zip((src, tgt), self.vocab, self.limits, ids)):
                sampled = self.sampling.sample(vocab, text, epoch, i, side)
                self.sampled += 1
                if len(sampled) > min(width, limit if limit is not None else width):
                    self.fallbacks += 1
                    sides.append(kept)
                else:
                    sides.append(np.asarray(sampled, dtype=np.int64))
            out.append((i, *sides))
        return out

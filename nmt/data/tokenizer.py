"""SentencePiece subwords with fixed special ids.

`nmt.data.prepare` trains the model on a sample of the train split and stores it in the
prepared folder (`<cache_dir>/prepared/<key>/spm.model`), whose key covers the corpus, the
options and the sentencepiece version; a second run with the same data and options loads it.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from nmt.specials import BOS, EOS, PAD, UNK  # noqa: F401  (re-exported for data code)
from nmt.machine import usable_cores

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "model_type": "unigram",          # unigram | bpe
    "vocab_size": 8000,
    "joint": True,                    # one vocabulary for source and target
    "character_coverage": 1.0,        # 0.9995 for Chinese/Japanese
    "hard_vocab_limit": False,        # vocab_size is an upper bound (tiny corpora)
    "input_sentence_size": 300_000,  # sample at most this many training sentences (~3 GB of trainer memory per 1M)
    "byte_fallback": False,
    "normalization_rule_name": "nmt_nfkc",
}


def _num_threads() -> int:
    return usable_cores()


# Characters no piece may hold: they would end or split an output line (line feeds, carriage
# returns, tabs, the other C0/C1 controls, U+2028/U+2029). Decoded text has them replaced by spaces.
LINE_BREAKING = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def check_vocabulary(sp: spm.SentencePieceProcessor, name: str) -> None:
    """A ValueError naming ``name`` unless the model has nmt's special ids and no piece holds a
    control or line-breaking character (a model from a file someone else wrote)."""
    ids = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
    if ids != (PAD, UNK, BOS, EOS):
        raise ValueError(f"{name}: special ids (pad, unk, bos, eos) are {ids}, expected {(PAD, UNK, BOS, EOS)}")
    for i in range(sp.get_piece_size()):
        try:
            piece = sp.id_to_piece(i)
        except UnicodeDecodeError as e:  # sentencepiece's text: the codec's, naming no model
            raise ValueError(f"{name}: piece {i} is not valid UTF-8 ({e.object[:40]!r}); a SentencePiece model "
                             "trained by nmt has none") from None
        if LINE_BREAKING.search(piece):
            raise ValueError(f"{name}: piece {i} ({piece[:40]!r}) holds a control or line-breaking character; "
                             "a SentencePiece model trained by nmt has none")


class Tokenizer:
    """A trained SentencePiece model: text <-> ids with PAD=0, UNK=1, BOS=2, EOS=3."""

    def __init__(self, model_file: str | Path) -> None:
        self.model_file = str(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=self.model_file)
        check_vocabulary(self.sp, self.model_file)
        self.trained = False  # True when this process trained the model (not read from cache)

    @classmethod
    def from_proto(cls, proto: bytes, name: str) -> Tokenizer:
        """A serialized model (a checkpoint's), checked as ``check_vocabulary``; ``name`` says where
        it came from. A ValueError for bytes that are not a SentencePiece model."""
        tok = cls.__new__(cls)
        tok.model_file, tok.trained = name, False
        try:
            tok.sp = spm.SentencePieceProcessor(model_proto=proto)
        except (RuntimeError, TypeError):  # sentencepiece's own message is a C++ source line
            raise ValueError(f"{name}: not a SentencePiece model (its bytes do not parse as one)") from None
        check_vocabulary(tok.sp, name)
        return tok

    @property
    def fingerprint(self) -> str:
        """A hash of the model's content (what tokenized-data caches are keyed on)."""
        return hashlib.blake2b(self.sp.serialized_model_proto(), digest_size=8).hexdigest()

    @property
    def pieces_digest(self) -> str:
        """A hash of the pieces and their scores: equal for two models that tokenize alike,
        wherever each was trained (the fingerprint hashes the training options too, output path included)."""
        sp = self.sp
        pieces = "\n".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i)!r}" for i in range(sp.get_piece_size()))
        return hashlib.blake2b(pieces.encode(), digest_size=8).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.model_file!r}, vocab_size={self.vocab_size})"

    def __getstate__(self) -> dict[str, Any]:  # the model travels with the object
        return {"model_file": self.model_file, "trained": self.trained,
                "proto": self.sp.serialized_model_proto()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model_file, self.trained = state["model_file"], state["trained"]
        self.sp = spm.SentencePieceProcessor(model_proto=state["proto"])

    def encode(self, text: str) -> list[int]:
        """Subword ids of one sentence, without BOS/EOS."""
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Subword ids of many sentences, encoded in parallel."""
        return self.sp.encode(list(texts), out_type=int, num_threads=_num_threads())

    def encode_flat(self, texts: Sequence[str], chunk: int = 20000) -> tuple[np.ndarray, np.ndarray]:
        """All sentences as (int32 tokens, int64 offsets): sentence j is tokens[offsets[j]:offsets[j+1]].

        Encodes `chunk` sentences at a time, so memory stays near the size of the arrays.
        """
        offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        parts = [np.zeros(0, dtype=np.int32)]
        for start in range(0, len(texts), chunk):
            ids = self.encode_batch(texts[start : start + chunk])
            lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            parts.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32,
                                     count=int(lens.sum())))
            offsets[start + 1 : start + 1 + len(ids)] = lens
        return np.concatenate(parts), np.cumsum(offsets)

    def _clean(self, ids: Iterable[int]) -> list[int]:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids  # type: ignore[union-attr]
        out = []
        for i in ids:
            if i == EOS:
                break
            if i not in (PAD, BOS):
                out.append(int(i))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Detokenized text on one line; stops at the first EOS, drops BOS and PAD (a byte-fallback
        piece that decodes to a line break becomes a space)."""
        return LINE_BREAKING.sub(" ", self.sp.decode(self._clean(ids)))

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        return [LINE_BREAKING.sub(" ", text) for text in self.sp.decode([self._clean(ids) for ids in batch])]

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """Subword strings of `ids` (specials included), e.g. for attention-plot labels."""
        ids = ids.tolist() if hasattr(ids, "tolist") else ids  # type: ignore[union-attr]
        return [self.sp.id_to_piece(int(i)) for i in ids]


def text_hash(*texts: Sequence[str]) -> str:
    """A fingerprint of one or more lists of sentences (content and order)."""
    h = hashlib.blake2b(digest_size=16)
    for lines in texts:
        h.update(len(lines).to_bytes(8, "little"))
        h.update("\n".join(lines).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def options_with_defaults(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The tokenizer options of a data config, defaults filled in."""
    return DEFAULTS | dict(options or {})


def train_sentencepiece(sentences: Iterable[str], out_dir: str | Path,
                        options: Mapping[str, Any], name: str = "spm") -> Tokenizer:
    """Train a model into `out_dir/<name>.model`; `options` as in `DEFAULTS` plus any trainer flag."""
    opts = {k: v for k, v in options_with_defaults(options).items() if k != "joint"}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(0)
    try:
        spm.SentencePieceTrainer.train(
            # a control or line-breaking character left in (U+0085, U+2028: SentencePiece's normalizer keeps
            # them) could become a piece, which every model nmt loads refuses: it trains as a space, and
            # encodes as <unk>
            sentence_iterator=(LINE_BREAKING.sub(" ", s) for s in sentences), model_prefix=str(out_dir / name),
            pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, pad_piece="<pad>",
            shuffle_input_sentence=True, max_sentence_length=65536,
            train_extremely_large_corpus=False, num_threads=_num_threads(), minloglevel=2, **opts)
    except (RuntimeError, ValueError) as e:
        from nmt.data.readers import DataError  # not nmt.data.sources, which imports `datasets`

        raise DataError(f"SentencePiece training failed with options {opts}: "
                        f"{str(e).rstrip('.')}. For a small "
                        "corpus set data.tokenizer.hard_vocab_limit=false or a smaller "
                        "data.tokenizer.vocab_size") from e
    try:
        tok = Tokenizer(out_dir / f"{name}.model")
    except RuntimeError as e:  # SentencePiece does not report a failed write: its model is then unreadable
        raise OSError(errno.EIO, "SentencePiece's model is unreadable right after training: the write failed",
                      str(out_dir / f"{name}.model")) from e
    tok.trained = True
    return tok

"""TranslationDataModule: any source -> validated pairs -> SentencePiece ids -> token batches.

One path for every corpus: `source.load()` gives a `datasets.DatasetDict` (train/valid/test,
columns src/tgt); empty pairs are dropped; SentencePiece is trained on train (or read from the
cache); all splits are tokenized into flat arrays cached under
`<cache_dir>/data/<hash>/`; then long training pairs are dropped or truncated. Valid and test
are never filtered: only the model input is truncated, `raw()` keeps the full references.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from nmt.checkpoint import saved_vocabularies
from nmt.data.batching import TokenBatchSampler, TokenizedSplit, collate, padding_ratio
from nmt.data.sources import SPLITS, DataError, columns, drop_empty, plain
from nmt.data.tokenizer import Tokenizer, load_or_train, options_with_defaults, text_hash

log = logging.getLogger(__name__)


def word_counts(texts: list[str], chars: bool = False) -> list[int]:
    """Length of each text in words, or in characters without spaces (``chars``, for Chinese)."""
    return [len("".join(t.split())) if chars else len(t.split()) for t in texts]

Flat = tuple[np.ndarray, np.ndarray]  # (int32 tokens, int64 offsets)


class ResumableLoader(DataLoader):
    """The training DataLoader; `state_dict` says how many batches of which epoch were consumed.

    `position()` gives (epoch, batches trained this epoch) from a Lightning trainer; without
    one the loader counts the batches it returned (worker prefetch is not counted).
    """

    def __init__(self, *args: Any, position: Callable[[], tuple[int, int] | None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position
        self._state: list[int] | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:  # type: ignore[override]
        sampler: TokenBatchSampler = self.batch_sampler  # type: ignore[assignment]
        pos = self.position() if self.position else None
        if pos is not None:
            sampler.set_epoch(pos[0])
        self._state = [sampler.epoch, sampler.resume_offset]
        for batch in super().__iter__():
            self._state[1] += 1
            yield batch
        self._state = None

    def state_dict(self) -> dict[str, Any]:
        pos = self.position() if self.position else None
        if pos is not None:
            return {"epoch": pos[0], "batches_yielded": pos[1]}
        if self._state is None:
            return self.batch_sampler.state_dict()  # type: ignore[union-attr]
        return {"epoch": self._state[0], "batches_yielded": self._state[1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)  # type: ignore[union-attr]


class TranslationDataModule(L.LightningDataModule):
    """Parallel text for training and evaluation, batched by tokens.

    source: an object with `load() -> DatasetDict` (see `nmt.data.sources`).
    tokenizer: SentencePiece options (`nmt.data.tokenizer.DEFAULTS`).
    max_src_len / max_tgt_len: subword limits without BOS/EOS; `too_long` drops or truncates
        longer training pairs. src_words: "words" | "chars", how `text_lengths` counts source.
    train_max_words: drop training pairs whose source (counted as `src_words`) or target has
        more words than this, before `train_pairs` draws its subset (Bahdanau et al. 2015 trained
        on sentences of at most 30 or 50 words); valid and test keep every length. None: no limit.
    train_pairs: train on a random subset of this many pairs (drawn with `seed`, kept in corpus
        order; the tokenizer is trained on it too); None keeps them all.
    vocab_from: use the SentencePiece models saved in this checkpoint (or this `.model` file, for
        both sides) instead of training a tokenizer (of `tokenizer`, only `joint` still counts and
        must say whether the two models are one). This continues a run on other training data
        (`ckpt_path=<run>/checkpoints/last.ckpt data.vocab_from=<same>`) or fine-tunes it, since a
        resumed run must keep its vocabulary. A run resumed mid-epoch on other data
        starts the new data's epoch as far in as the old one was (those batches are skipped once).
    """

    def __init__(self, source: Any, tokenizer: dict | DictConfig | None, src_lang: str,
                 tgt_lang: str, max_tokens: int | None = 4096, batch_size: int | None = None,
                 max_src_len: int = 256, max_tgt_len: int = 256, too_long: str = "drop",
                 src_words: str = "words", num_workers: int = 0, cache_dir: str = ".cache",
                 seed: int = 0, eval_max_tokens: int | None = None, train_pairs: int | None = None,
                 train_max_words: int | None = None, vocab_from: str | None = None) -> None:
        super().__init__()
        if too_long not in ("drop", "truncate"):
            raise ValueError(f"too_long must be 'drop' or 'truncate', got {too_long!r}")
        if src_words not in ("words", "chars"):
            raise ValueError(f"src_words must be 'words' or 'chars', got {src_words!r}")
        if isinstance(source, (dict, DictConfig)):
            source = instantiate(source)
        if isinstance(source, functools.partial):
            source = source()
        self.source = source
        self.tokenizer_options = options_with_defaults(plain(tokenizer))
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.max_tokens, self.batch_size = max_tokens, batch_size
        self.eval_max_tokens = eval_max_tokens or max_tokens
        self.max_src_len, self.max_tgt_len, self.too_long = max_src_len, max_tgt_len, too_long
        self.src_words, self.num_workers = src_words, num_workers
        self.cache_dir, self.seed = Path(cache_dir), seed
        if train_pairs is not None and train_pairs < 1:
            raise ValueError(f"train_pairs must be a positive number of sentence pairs or null, got {train_pairs}")
        self.train_pairs = train_pairs
        if train_max_words is not None and train_max_words < 1:
            raise ValueError(f"train_max_words must be a positive number of words or null, got {train_max_words}")
        self.train_max_words = train_max_words
        self.vocab_from = vocab_from
        self.joint_vocab = bool(self.tokenizer_options["joint"])
        self.src_vocab: Tokenizer
        self.tgt_vocab: Tokenizer
        self.datasets: dict[str, TokenizedSplit] = {}
        self.stats: dict[str, dict[str, int]] = {}
        self.prepare_seconds = 0.0
        self.train_padding: float | None = None  # padded fraction of an epoch of training batches
        self._texts: dict[str, tuple[list[str], list[str]]] = {}
        self._raw: dict[str, tuple[list[str], list[str]]] = {}

    # -- preparation -------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Build the caches once (Lightning calls this on one process before `setup`)."""
        self.setup()

    def setup(self, stage: str | None = None) -> None:
        """Load, validate, tokenize (cached) and filter every split; a no-op the second time."""
        if self.datasets:
            return
        start = time.perf_counter()
        data = self.source.load()
        missing = [s for s in SPLITS if s not in data]
        if missing:
            raise DataError(f"the source gave splits {list(data)}; missing {missing}")
        for split in SPLITS:
            src, tgt = columns(data[split])
            read = len(src)
            src, tgt, empty = drop_empty(src, tgt, split)
            if not src:
                raise DataError(f"split {split!r} has no sentence pairs")
            self.stats[split] = {"read": read, "empty_dropped": empty}
            if split == "train" and self.train_max_words is not None:
                src, tgt = self._within_max_words(src, tgt)
            if split == "train" and self.train_pairs is not None and len(src) > self.train_pairs:
                keep = np.sort(np.random.default_rng(self.seed).choice(len(src), self.train_pairs, replace=False))
                src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
                self.stats[split]["subsampled_to"] = self.train_pairs
            self._texts[split] = (src, tgt)
        log.info("read %s pairs in %.1fs", " / ".join(f"{s} {len(self._texts[s][0])}"
                                                      for s in SPLITS), time.perf_counter() - start)
        hashes = {s: (text_hash(src), text_hash(tgt)) for s, (src, tgt) in self._texts.items()}
        self._build_vocab(hashes["train"])
        flat = self._tokenized(hashes)
        for split in SPLITS:
            self.datasets[split] = self._filter(split, *flat[split])
        self.prepare_seconds = time.perf_counter() - start
        train = self.datasets["train"]
        sampler = TokenBatchSampler(train.lengths(), self.max_tokens, self.batch_size, seed=self.seed)
        self.train_padding = padding_ratio(sampler.all_batches(), sampler.lengths)
        log.info("data ready in %.1fs: %s; training batches %d, padding %.1f%%",
                 self.prepare_seconds, ", ".join(f"{s} {len(d)}" for s, d in self.datasets.items()),
                 len(sampler), 100 * self.train_padding)

    def _build_vocab(self, train_hash: tuple[str, str]) -> None:
        if self.vocab_from is not None:
            self.src_vocab, self.tgt_vocab = saved_vocabularies(self.vocab_from)
            if self.joint_vocab and self.src_vocab is not self.tgt_vocab:  # models share embeddings when joint
                raise ValueError(f"data.vocab_from={self.vocab_from} has separate source and target "
                                 "vocabularies: set data.tokenizer.joint=false")
            return
        src, tgt = self._texts["train"]
        args = (self.cache_dir, self.tokenizer_options)
        if self.joint_vocab:
            self.src_vocab = self.tgt_vocab = load_or_train([src, tgt], "+".join(train_hash), *args)
        else:
            self.src_vocab = load_or_train(src, train_hash[0], *args, name=self.src_lang)
            self.tgt_vocab = load_or_train(tgt, train_hash[1], *args, name=self.tgt_lang)

    def _tokenized(self, hashes: dict[str, tuple[str, str]]) -> dict[str, tuple[Flat, Flat]]:
        """Every split as flat id arrays, from `<cache_dir>/data/<hash>/` or encoded now."""
        key = json.dumps({"data": hashes, "src": self.src_vocab.fingerprint, "tgt": self.tgt_vocab.fingerprint},
                         sort_keys=True)
        folder = self.cache_dir / "data" / hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
        names = [f"{s}.{side}.{part}" for s in SPLITS for side in ("src", "tgt")
                 for part in ("tokens", "offsets")]
        start = time.perf_counter()
        if folder.is_dir():
            arrays = {n: np.load(folder / f"{n}.npy") for n in names}
            log.info("tokenized data: loaded %s in %.2fs", folder, time.perf_counter() - start)
        else:
            arrays = {}
            for s in SPLITS:
                for side, vocab, texts in zip(("src", "tgt"), (self.src_vocab, self.tgt_vocab),
                                              self._texts[s]):
                    arrays[f"{s}.{side}.tokens"], arrays[f"{s}.{side}.offsets"] = vocab.encode_flat(texts)
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
            try:
                for n, a in arrays.items():
                    np.save(tmp / f"{n}.npy", a)
                (tmp / "key.json").write_text(key + "\n")
                tmp.rename(folder)
            except OSError:  # another process wrote it first
                pass
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("tokenized data: built %s in %.1fs", folder, time.perf_counter() - start)
        return {s: ((arrays[f"{s}.src.tokens"], arrays[f"{s}.src.offsets"]),
                    (arrays[f"{s}.tgt.tokens"], arrays[f"{s}.tgt.offsets"])) for s in SPLITS}

    def _filter(self, split: str, src: Flat, tgt: Flat) -> TokenizedSplit:
        src_len, tgt_len = np.diff(src[1]), np.diff(tgt[1])
        long = (src_len > self.max_src_len) | (tgt_len > self.max_tgt_len)
        stats = self.stats[split]
        stats["src_truncated"] = stats["tgt_truncated"] = stats["too_long_dropped"] = 0
        if split == "train" and self.too_long == "drop":
            index = np.flatnonzero(~long)
            stats["too_long_dropped"] = int(long.sum())
            if long.any():
                log.info("%s: dropped %d of %d pairs longer than %d/%d subwords", split,
                         long.sum(), len(long), self.max_src_len, self.max_tgt_len)
        else:
            index = np.arange(len(src_len))
            stats["src_truncated"] = int((src_len > self.max_src_len).sum())
            stats["tgt_truncated"] = int((tgt_len > self.max_tgt_len).sum())
            if long.any():
                log.info("%s: truncating %d source / %d target sentences to %d/%d subwords "
                         "(model input only)", split, stats["src_truncated"],
                         stats["tgt_truncated"], self.max_src_len, self.max_tgt_len)
        stats["pairs"] = len(index)
        return TokenizedSplit(src, tgt, index, self.max_src_len, self.max_tgt_len)

    # -- access ------------------------------------------------------------------------
    def raw(self, split: str) -> tuple[list[str], list[str]]:
        """Source and reference strings of `split` in dataset order (batch `ids` index them)."""
        if split not in self._raw:
            src, tgt = self._texts[split]
            index = self.datasets[split].index
            if len(index) == len(src):
                self._raw[split] = (src, tgt)
            else:
                self._raw[split] = ([src[i] for i in index], [tgt[i] for i in index])
        return self._raw[split]

    def text_lengths(self, split: str, side: str = "src") -> np.ndarray:
        """Lengths of `raw(split)` sentences: source per `src_words` (words | chars), target words."""
        texts = self.raw(split)[0 if side == "src" else 1]
        return np.array(word_counts(texts, chars=side == "src" and self.src_words == "chars"), dtype=np.int64)

    def _within_max_words(self, src: list[str], tgt: list[str]) -> tuple[list[str], list[str]]:
        """The training pairs with at most ``train_max_words`` on both sides (counted as `text_lengths`)."""
        limit = self.train_max_words
        keep = [i for i, (s, t) in enumerate(zip(word_counts(src, self.src_words == "chars"), word_counts(tgt)))
                if s <= limit and t <= limit]
        self.stats["train"]["over_max_words_dropped"] = len(src) - len(keep)
        log.info("train: kept %d of %d pairs of at most %d words", len(keep), len(src), limit)
        if not keep:
            raise DataError(f"no training pair has at most data.train_max_words={limit} "
                            "words on both sides; raise the limit or set it to null")
        return [src[i] for i in keep], [tgt[i] for i in keep]

    def _replicas(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _position(self) -> tuple[int, int] | None:
        """(epoch, batches trained in it) of the attached trainer, if any."""
        trainer = self.trainer
        try:
            done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[union-attr]
        except AttributeError:
            return None
        return trainer.current_epoch, done  # type: ignore[union-attr]

    def _pin_memory(self) -> bool:
        """Page-locked batches when training on a GPU (copies overlap with compute)."""
        return self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"

    def _loader(self, dataset: TokenizedSplit, sampler: TokenBatchSampler) -> DataLoader:
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                          pin_memory=self._pin_memory())

    def train_dataloader(self) -> DataLoader:
        self.setup()
        world, rank = self._replicas()
        dataset = self.datasets["train"]
        overfit = self.trainer is not None and self.trainer.overfit_batches > 0  # the same few batches each epoch
        sampler = TokenBatchSampler(dataset.lengths(), self.max_tokens, self.batch_size,
                                    shuffle=not overfit, seed=self.seed, num_replicas=world, rank=rank)
        if self.trainer is not None:
            sampler.set_epoch(self.trainer.current_epoch)
        return ResumableLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                               num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                               pin_memory=self._pin_memory(), position=self._position if self.trainer is not None else None)

    def _eval_loader(self, split: str) -> DataLoader:
        self.setup()
        world, rank = self._replicas()
        dataset = self.datasets[split]
        sampler = TokenBatchSampler(dataset.lengths(), self.eval_max_tokens, self.batch_size,
                                    shuffle=False, num_replicas=world, rank=rank)
        return self._loader(dataset, sampler)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("valid")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    def predict_loader(self, src_texts: list[str], max_tokens: int | None = None,
                       batch_size: int | None = None) -> DataLoader:
        """Batches of arbitrary source sentences (no target keys); `ids` index `src_texts`."""
        self.setup()
        if max_tokens is None and batch_size is None:
            max_tokens, batch_size = self.eval_max_tokens, self.batch_size
        dataset = TokenizedSplit(self.src_vocab.encode_flat(src_texts), None,
                                 max_src_len=self.max_src_len)
        sampler = TokenBatchSampler(dataset.lengths(), max_tokens, batch_size, shuffle=False)
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)

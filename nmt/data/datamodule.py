"""TranslationDataModule: any source -> prepared memory-mapped arrays -> token batches.

One path for every corpus: `nmt.data.prepare` streams the source once into
`<cache_dir>/prepared/<key>/` (text, SentencePiece ids and word counts as `.npy` files, the
tokenizer, a manifest); every later run, and every DDP rank, opens those files memory-mapped, so
start-up does not grow with the corpus and ranks share the pages. The training-pair selection
(`train_max_words`, `train_pairs`) and the length filter run on arrays. Valid and test are never
filtered: only the model input is truncated, `raw()` keeps the full references.

Every DataLoader has a `torch.Generator` of its own, seeded from (`seed`, rank): creating an
iterator draws its workers' base seed from it, never from the global torch RNG, whose state a
checkpoint saves and a resumed run restores (`nmt.training.lit_module`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as L
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from nmt.languages import writing
from nmt.languages.tags import tag_in_vocabulary
from nmt.data.alignments import AlignedSplit, WordLinks, collate_aligned, prepare_alignments
from nmt.data.augment import AugmentedSplit, Augmentation
from nmt.data.batching import TokenBatchSampler, TokenizedSplit, collate
from nmt.data.multilingual import sampling_changes, temperature_items
from nmt.data.prepare import SIDES, TextColumn, prepare, read_manifest, select_train, source_sample
from nmt.data.shapes import SHAPES, ShapeBuckets
from nmt.data.sources import SPLITS, DataError, plain
from nmt.data.subword_sampling import SampledSplit, SubwordSampling, model_type
from nmt.data.tokenizer import Tokenizer, options_with_defaults
from nmt.machine import usable_cores

log = logging.getLogger(__name__)

VALID_SAMPLE_STREAM = 0x76616C  # the validation sample's own random stream beside the seed


def stored(split: str) -> str:
    """The prepared split a split's pairs are read from (the validation sample: valid's)."""
    return "valid" if split == "valid_sample" else split


Flat = tuple[np.ndarray, np.ndarray]  # (uint16/uint32 tokens, int64 offsets), memory-mapped


class ResumableLoader(DataLoader):
    """The training DataLoader; `state_dict` says how many batches of which epoch were consumed,
    by this rank and by all ranks together (`TokenBatchSampler.state_dict`).

    `position()` gives (epoch, batches trained this epoch) from a Lightning trainer; without
    one the loader counts the batches it returned (worker prefetch is not counted). `recount(done)`
    sets the trainer's count of the epoch's batches done when a resume on another number of ranks
    gives this rank another share of the epoch's rest (`TokenBatchSampler.rank_done`).
    """

    def __init__(self, *args: Any, position: Callable[[], tuple[int, int] | None] | None = None,
                 recount: Callable[[int], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position
        self.recount = recount
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
        sampler: TokenBatchSampler = self.batch_sampler  # type: ignore[assignment]
        pos = self.position() if self.position else None
        if pos is None and self._state is None:
            return sampler.state_dict()
        epoch, done = pos if pos is not None else self._state
        if epoch == sampler.epoch:
            together = sampler.global_batches(done)
        else:  # the sampler's pass over `epoch` has ended (the loop still runs its last batch), or not begun
            together = sampler.epoch_size(epoch) if epoch < sampler.epoch else 0
        return {"epoch": epoch, "batches_yielded": done, "global_batches": together,
                "num_replicas": sampler.num_replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler: TokenBatchSampler = self.batch_sampler  # type: ignore[assignment]
        sampler.load_state_dict(state)
        saved_ranks = state.get("num_replicas", sampler.num_replicas)
        if self.recount is not None and saved_ranks != sampler.num_replicas:
            done = sampler.rank_done(state)
            log.info("the checkpoint was trained on %d process(es), this run has %d: epoch %d goes on after the %d "
                     "of its %d batches they trained, the rest split over %d process(es), %d batches each",
                     saved_ranks, sampler.num_replicas, state["epoch"], state["global_batches"],
                     sampler.epoch_size(int(state["epoch"])), sampler.num_replicas, len(sampler) - done)
            self.recount(done)


class TranslationDataModule(L.LightningDataModule):
    """Parallel text for training and evaluation, batched by tokens.

    source: an object with `describe()` and `pairs(split)` (see `nmt.data.sources`; one with only
        `load() -> DatasetDict` is read whole); prepared once by `nmt.data.prepare`.
    tokenizer: SentencePiece options (`nmt.data.tokenizer.DEFAULTS`); the model is trained on
        `input_sentence_size` training sentences drawn across the whole corpus.
    max_src_len / max_tgt_len: subword limits without BOS/EOS; `too_long` drops or truncates
        longer training pairs. src_words: how a source's length is counted (the reports' buckets,
        `train_max_words`, `text_lengths`): "words", "chars", "tokens" (its source SentencePiece
        pieces, in the reports; words or characters, as auto, in the prepared data) or "auto": the
        source language's unit (a source's own `length_unit`, as the synthetic languages'; else
        `nmt.languages.writing`: characters for Chinese, Japanese, Thai...), judged from the test sources
        for a code it does not know (and said in the log). `src_words` holds the resolved words | chars.
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
    vocab_loader: reads `vocab_from` into (source, target) tokenizers: the checkpoint reader
        `saved_vocabularies`, passed by `nmt.training.builders.build_datamodule` or named by the entry
        point's config (`vocab_loader` in prepare.yaml, stats.yaml); nmt.data reads no checkpoint.
    augment: robustness augmentation of the training pairs, a list of `{name, rate}`
        (`nmt.data.augment`: upper, title, noise); each epoch draws the pairs it changes. The
        number of batches then varies by epoch: the trainer must reload its training loader
        every epoch (`trainer.reload_dataloaders_every_n_epochs=1`, as `augment=robust` sets).
    subword_sampling: subword regularization of the training pairs (`nmt.data.subword_sampling`):
        `{enabled, alpha, nbest_size}` (unigram models, Kudo 2018) or `{enabled, dropout}` (BPE
        models, BPE-dropout); each epoch segments every training sentence anew, from its text.
        `length_margin` stretches the lengths the batches are planned on. None: the stored ids.
    val_sample: validation during training decodes a fixed sample of this many valid pairs
        (drawn once with `seed`, kept in corpus order), so that it does not dominate training on a
        large development set; `validate_in_full()` switches to every pair (train() does, after
        fit, for the final weights). None, or a number at least the split's size: every pair.
    temperature: with a source of several directions (`nmt.data.multilingual.MultilingualSource`),
        each epoch samples its training pairs by direction with this temperature
        (`temperature_items`); directions of unequal sizes then change the number of batches by
        epoch, as `augment` does. None or 1: every pair once an epoch. The source's target-language
        tags become pieces of their own in the vocabulary (SentencePiece `user_defined_symbols`).
    splits: the splits to prepare and open (default all); with `vocab_from`, a reader of one
        split (`nmt-evaluate`: the test split) prepares that split alone, not a million training
        pairs it never reads. Training needs all three. train_text: without "train" in `splits`,
        read the training text too, without encoding it (`train_rows` and `raw("train")` then
        give the pairs the config selects by `train_max_words` and `train_pairs`).
    shapes: training batches padded exactly (`exact`) or to a bounded set of shapes (`buckets`,
        `nmt.data.shapes`) that compiled graphs reuse; `auto` is resolved by `nmt.train` for the
        training device (buckets on a GPU), and read as `exact` where nothing resolved it.
    alignments: word alignments of the training pairs for guided-alignment training
        (`nmt.data.alignments`): a Pharaoh file, line i aligning training pair i, or `eflomal` to
        compute them when the data are prepared; training batches then carry `align`. None: none.
    """

    def __init__(self, source: Any, tokenizer: dict | DictConfig | None, src_lang: str,
                 tgt_lang: str, max_tokens: int | None = 4096, batch_size: int | None = None,
                 max_src_len: int = 256, max_tgt_len: int = 256, too_long: str = "drop",
                 src_words: str = "words", num_workers: int | str = 0, cache_dir: str = ".cache",
                 seed: int = 0, eval_max_tokens: int | None = None, train_pairs: int | None = None,
                 train_max_words: int | None = None, vocab_from: str | None = None,
                 vocab_loader: Callable[[str], tuple[Tokenizer, Tokenizer]] | None = None,
                 augment: list | None = None, temperature: float | None = None,
                 val_sample: int | None = None, splits: list[str] | tuple[str, ...] | None = None,
                 train_text: bool = False, shapes: str = "exact", alignments: str | None = None,
                 subword_sampling: dict | DictConfig | None = None) -> None:
        super().__init__()
        self.splits = SPLITS if splits is None else tuple(splits)
        self.text_only = ("train",) if train_text and "train" not in self.splits else ()
        self._train_text_rows: np.ndarray | None = None
        if not self.splits or any(s not in SPLITS for s in self.splits):
            raise ValueError(f"splits={list(self.splits)}: choose among {', '.join(SPLITS)}")
        if self.splits != SPLITS and vocab_from is None:
            raise ValueError(f"splits={list(self.splits)}: preparing some splits alone needs data.vocab_from "
                             "(a tokenizer is trained on the training split)")
        if too_long not in ("drop", "truncate"):
            raise ValueError(f"too_long must be 'drop' or 'truncate', got {too_long!r}")
        if src_words not in writing.SETTINGS:
            raise ValueError(f"data.src_words={src_words!r}: choose {', '.join(writing.SETTINGS)}")
        if num_workers != "auto" and (isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0):
            raise ValueError(f"data.num_workers={num_workers!r}: a number of processes (0: none) or auto")
        if shapes not in SHAPES:
            raise ValueError(f"data.shapes={shapes}: choose {', '.join(SHAPES)}")
        self.alignments = None if alignments is None else str(alignments)
        self.alignment_dir: Path | None = None  # <prepared>/alignments/<key>/, set by `prepare_data`
        self.shapes = shapes  # auto: train() resolves it for the training device; unresolved, exact
        if isinstance(source, (dict, DictConfig)):  # Hydra builds the source (its _target_) before the module
            raise TypeError("source: a data source object, not a mapping; give the source config a _target_ "
                            "(nmt.data.sources.FileSource or SyntheticSource)")
        if isinstance(source, functools.partial):
            source = source()
        self.source = source
        self.tokenizer_options = options_with_defaults(plain(tokenizer))
        self.tags = list(getattr(source, "tags", []))  # target-language tags: one piece each
        if self.tags:
            given = self.tokenizer_options.get("user_defined_symbols") or []
            given = given.split(",") if isinstance(given, str) else list(given)
            self.tokenizer_options["user_defined_symbols"] = sorted(set(given) | set(self.tags))
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                        or not 1 <= temperature <= 1000):
            raise ValueError(f"data.temperature={temperature}: a number from 1 (the corpus proportions) to 1000 "
                             "(close to equal shares of the directions), or null")
        self.temperature = temperature
        if val_sample is not None and (isinstance(val_sample, bool) or not isinstance(val_sample, int) or val_sample < 1):
            raise ValueError(f"data.val_sample={val_sample!r}: a positive number of validation pairs, or null for all")
        self.val_sample = val_sample
        self.val_split = "valid"  # what validation decodes: "valid", or "valid_sample" (see val_sample)
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        sizes = {"max_tokens": (max_tokens, "tokens a batch"),
                 "eval_max_tokens": (eval_max_tokens, "tokens an evaluation batch, or null (data.max_tokens)"),
                 "batch_size": (batch_size, "sentences a batch, or null (batches of data.max_tokens tokens only)")}
        for key, (value, what) in sizes.items():  # 0 hung training, -1 failed inside NumPy
            if value is None or key == "max_tokens" and value == "auto":  # train() sizes auto before building this
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{key}={value!r}: a positive whole number of {what}")
        if max_tokens is None and batch_size is None:
            raise ValueError("data.max_tokens and data.batch_size are both null: set one (tokens or sentences a batch)")
        self.max_tokens, self.batch_size = max_tokens, batch_size
        self.eval_max_tokens = eval_max_tokens or max_tokens
        self.max_src_len, self.max_tgt_len, self.too_long = max_src_len, max_tgt_len, too_long
        self.src_words_setting, self.num_workers = src_words, num_workers
        # how the prepared data count a source's length: words | chars; auto: the source's own unit (the
        # synthetic languages'), the language's (nmt.languages.writing), or None until read from the text
        self.src_words: str | None = src_words if src_words in ("words", "chars") else (
            getattr(source, "length_unit", None) or (writing.length_unit(src_lang) if writing.writing(src_lang) else None))
        self.cache_dir, self.seed = Path(cache_dir), seed
        if train_pairs is not None and train_pairs < 1:
            raise ValueError(f"train_pairs must be a positive number of sentence pairs or null, got {train_pairs}")
        self.train_pairs = train_pairs
        if train_max_words is not None and train_max_words < 1:
            raise ValueError(f"train_max_words must be a positive number of words or null, got {train_max_words}")
        self.train_max_words = train_max_words
        self.vocab_from, self.vocab_loader = vocab_from, vocab_loader
        self.augmentation = Augmentation(plain(augment), seed)  # a bad entry raises here, naming data.augment[i]
        self.subword_sampling_options = plain(subword_sampling)
        self.subword_sampling = SubwordSampling.from_config(  # a bad or mismatched key raises here; vocab_from: in _open
            self.subword_sampling_options, self.tokenizer_options["model_type"], seed)
        self._train_items: Any = None  # what the training loader reads: the train split, augmented or not
        self.origins: dict[str, np.ndarray] = {}  # split -> each pair's direction (a source of several)
        self.origin_names: list[str] = []  # the names of the origins' values ("de-en", ...)
        self.joint_vocab = bool(self.tokenizer_options["joint"])
        self.src_vocab: Tokenizer
        self.tgt_vocab: Tokenizer
        self.datasets: dict[str, TokenizedSplit] = {}
        self.stats: dict[str, dict[str, int]] = {}
        self.prepare_seconds = 0.0
        self.train_padding: float | None = None  # padded fraction of an epoch of training batches
        self._raw: dict[str, tuple[list[str], list[str]]] = {}
        self.prepared_dir: Path | None = None  # <cache_dir>/prepared/<key>/, set by `prepare_data`
        self._prepared_now = False
        self._train_sampler: TokenBatchSampler | None = None
        self._ranks_checked = False  # set once the DDP ranks were found to hold the same data

    # -- preparation -------------------------------------------------------------------
    def prepare_data(self, workers: int | None = None) -> None:
        """Write the prepared folder unless it exists (Lightning calls this on one process before
        `setup`; `setup` calls it too). workers: encoding processes (default: one per core)."""
        if self.prepared_dir is not None:
            return
        vocab = None
        if self.vocab_from is not None:
            if self.vocab_loader is None:
                raise ValueError(f"data.vocab_from={self.vocab_from}: this data module has no vocab_loader to read "
                                 "it with (build it with nmt.training.builders.build_datamodule)")
            vocab = self.vocab_loader(self.vocab_from)
            if self.joint_vocab and vocab[0] is not vocab[1]:  # models share embeddings when joint
                raise ValueError(f"data.vocab_from={self.vocab_from} has separate source and target "
                                 "vocabularies: set data.tokenizer.joint=false")
            self.src_vocab, self.tgt_vocab = vocab
            missing = [t for t in self.tags if not tag_in_vocabulary(vocab[0].sp, t)]  # <2fr>, or an imported ▁<2fr>
            if missing:
                raise DataError(f"data.vocab_from={self.vocab_from}: its vocabulary has no piece for the "
                                f"target-language tag(s) {', '.join(missing)} of data.source; a multilingual "
                                "model continues from a model trained with those languages")
        if self.src_words is None:  # a language code nmt.languages.writing does not know: the text tells
            split = "test" if "test" in self.splits else self.splits[0]
            self.src_words = writing.length_unit(self.src_lang, source_sample(self.source, split))
        start = time.perf_counter()
        self.prepared_dir, self._prepared_now = prepare(
            self.source, self.cache_dir, self.tokenizer_options, vocab, self.src_words,
            self.train_max_words, self.train_pairs, self.seed, workers, self.splits, self.text_only)
        log.info("tokenized data: %s %s in %.2fs", "built" if self._prepared_now else "loaded",
                 self.prepared_dir, time.perf_counter() - start)
        if self.alignments is not None and "train" in self.splits:
            self.alignment_dir = prepare_alignments(self.alignments, self.source, self.prepared_dir)

    def setup(self, stage: str | None = None) -> None:
        """Open the prepared arrays (preparing them first when absent), select and filter the
        training pairs; a no-op the second time. Called by Lightning (a `stage`) under DDP, it
        also checks that every rank opened the same data."""
        if not self.datasets:
            self._open()
        if stage is not None and not self._ranks_checked:
            self._check_ranks_agree()

    def _check_ranks_agree(self) -> None:
        """Under DDP, a DataError unless every rank has the same vocabularies and training pairs.
        Nodes without a shared disk each prepare their own copy of the data; a tokenizer trained
        differently on one would train the ranks on different ids without any other error."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        mine = {"src vocabulary": self.src_vocab.pieces_digest, "tgt vocabulary": self.tgt_vocab.pieces_digest,
                "training pairs": len(self.datasets.get("train", ()))}
        ranks: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
        differ = [key for key in mine if any(r[key] != ranks[0][key] for r in ranks)]
        if differ:
            raise DataError(f"the DDP ranks opened different data ({', '.join(differ)}: "
                            f"{[[r[key] for r in ranks] for key in differ]} by rank); prepare it once and give "
                            "every node a copy of that cache folder (paths.cache_dir), or data.vocab_from=<ckpt>")
        self._ranks_checked = True

    def _open(self) -> None:
        start = time.perf_counter()
        self.prepare_data()
        folder = self.prepared_dir
        assert folder is not None
        manifest = read_manifest(folder)
        if self.vocab_from is None:
            files = {side: manifest["tokenizer"][side]["file"] for side in SIDES}
            self.src_vocab = Tokenizer(folder / files["src"])
            self.tgt_vocab = self.src_vocab if files["tgt"] == files["src"] else Tokenizer(folder / files["tgt"])
            self.src_vocab.trained = self.tgt_vocab.trained = self._prepared_now
        arrays = lambda name: np.load(folder / f"{name}.npy", mmap_mode="r")  # noqa: E731
        for split in self.splits:
            counts = manifest["splits"][split]
            self.stats[split] = {"read": counts["read"], "empty_dropped": counts["empty_dropped"]}
            index = None
            if split == "train":
                words = [arrays(f"train.{side}.words") for side in SIDES]
                index, selection = select_train(*words, self.train_max_words, self.train_pairs, self.seed)
                self.stats[split] |= selection
            sides = [(arrays(f"{split}.{side}.tokens"), arrays(f"{split}.{side}.offsets")) for side in SIDES]
            sizes = tuple(arrays(f"{split}.{side}.lengths") for side in SIDES)
            self.datasets[split] = self._filter(split, *sides, index, sizes)
            if (folder / f"{split}.origin.npy").is_file():
                kept = self.datasets[split].index
                origin = np.asarray(arrays(f"{split}.origin"))
                self.origins[split] = origin if kept is None else origin[kept]
        self.origin_names = list(manifest.get("origins") or [])
        if "train" not in self.splits:  # a reader of valid or test: no training batches
            if self.text_only:
                words = [arrays(f"train.{side}.words") for side in SIDES]
                rows = select_train(*words, self.train_max_words, self.train_pairs, self.seed)[0]
                self._train_text_rows = np.arange(len(words[0])) if rows is None else rows
            self.prepare_seconds = time.perf_counter() - start
            return
        self._sample_valid()
        if self.temperature is not None and "train" not in self.origins:
            log.warning("data.temperature=%s: the source has one direction; every training pair is read once an epoch",
                        self.temperature)
        train = self.datasets["train"]
        if self.subword_sampling is not None:
            self._check_sampling_kind()
        options = {"sampler": 1, "max_tokens": self.max_tokens, "batch_size": self.batch_size, "seed": self.seed,
                   "max_len": [self.max_src_len, self.max_tgt_len], "too_long": self.too_long,
                   "train_max_words": self.train_max_words, "train_pairs": self.train_pairs,
                   **({"augment": self.augmentation.describe()} if self.augmentation else {}),
                   **({"temperature": self.temperature} if self._sampled() else {}),
                   **({"subword_sampling": self.subword_sampling.describe()} if self.subword_sampling else {}),
                   **({"shapes": "buckets"} if self.shapes == "buckets" else {})}
        share = folder / "epochs" / hashlib.blake2b(json.dumps(options).encode(), digest_size=8).hexdigest()
        self._train_items = train if not self.augmentation else AugmentedSplit(
            train, (TextColumn(folder, "train.src"), TextColumn(folder, "train.tgt")),
            (self.src_vocab, self.tgt_vocab), self.augmentation)
        if self.subword_sampling is not None:
            self._train_items = SampledSplit(self._train_items, (TextColumn(folder, "train.src"),
                                                                 TextColumn(folder, "train.tgt")),
                                             (self.src_vocab, self.tgt_vocab), self.subword_sampling)
        if self.alignment_dir is not None:  # word alignments lifted to the pieces of each item (sampled or stored)
            self._train_items = AlignedSplit(self._train_items, WordLinks(self.alignment_dir), (self.src_vocab, self.tgt_vocab))
        self._build_train_sampler(share)
        self.prepare_seconds = time.perf_counter() - start
        log.info("data ready in %.1fs: %s; training batches %d, padding %.1f%%",
                 self.prepare_seconds, ", ".join(f"{s} {len(d)}" for s, d in self.datasets.items()),
                 len(self._train_sampler), 100 * self.train_padding)

    def _check_sampling_kind(self) -> None:
        """``subword_sampling`` for the vocabulary's real model type (a ``vocab_from`` model's may
        differ from ``data.tokenizer.model_type``)."""
        kinds = sorted({model_type(vocab) for vocab in (self.src_vocab, self.tgt_vocab)})
        if kinds == [self.subword_sampling.kind]:
            return
        where = "data.vocab_from" if self.vocab_from else "the prepared tokenizer"
        if len(kinds) > 1:
            raise ValueError(f"data.subword_sampling.enabled=true: {where} has a {kinds[0]} and a {kinds[1]} "
                             "model; sampling needs both sides of one type")
        self.subword_sampling = SubwordSampling.from_config(
            self.subword_sampling_options, kinds[0], self.seed, typed=f"the model type of {where}")

    def _build_train_sampler(self, share: Path) -> None:
        train = self._train_items if self.subword_sampling is not None else self.datasets["train"]
        self._train_sampler = TokenBatchSampler(train.lengths(), self.max_tokens, self.batch_size, seed=self.seed,
                                                share=share,  # DDP ranks map the epochs rank 0 built
                                                lengths_of_epoch=getattr(self._train_items, "lengths_of_epoch", None),
                                                items_of_epoch=functools.partial(
                                                    temperature_items, self.origins["train"], self.temperature,
                                                    self.seed) if self._sampled() else None,
                                                shapes=self._shape_buckets())
        self.train_padding = self._train_sampler.padding()  # builds epoch 0, which training reuses

    def set_max_tokens(self, max_tokens: int) -> None:
        """Cut the training batches to ``max_tokens`` from now on (``data.max_tokens=auto``'s probe,
        before training starts); validation and test keep theirs."""
        self.setup()
        assert self._train_sampler is not None, "set_max_tokens needs the training split"
        self.max_tokens = max_tokens
        share = self._train_sampler.share
        if share is not None:  # the epochs of another batch size are others
            share = share.with_name(f"{share.name}-{max_tokens}")
        self._build_train_sampler(share)
        log.info("training batches of at most %d tokens: %d batches, padding %.1f%%", max_tokens,
                 len(self._train_sampler), 100 * self.train_padding)

    def _shape_buckets(self) -> ShapeBuckets | None:
        """How training batches are padded: to shape buckets (``data.shapes=buckets``), or exactly."""
        return ShapeBuckets(self.max_tokens) if self.shapes == "buckets" else None

    def _sample_valid(self) -> None:
        """The ``valid_sample`` split: ``val_sample`` pairs of valid drawn with the seed (a stream of
        their own), in corpus order; validation reads it until ``validate_in_full``."""
        valid = self.datasets["valid"]
        if self.val_sample is None or self.val_sample >= len(valid):
            return
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, VALID_SAMPLE_STREAM]))
        positions = np.sort(rng.choice(len(valid), self.val_sample, replace=False))
        self.datasets["valid_sample"] = TokenizedSplit(valid.src, valid.tgt, valid.index[positions], valid.max_src_len,
                                                       valid.max_tgt_len, sizes=valid.sizes)
        if "valid" in self.origins:
            self.origins["valid_sample"] = self.origins["valid"][positions]
        self.val_split = "valid_sample"

    def validate_in_full(self) -> bool:
        """Validation reads every valid pair from now on; False if it already did."""
        was, self.val_split = self.val_split, "valid"
        return was != "valid"

    def _sampled(self) -> bool:
        """Whether the epochs sample the training pairs by direction (`temperature` changes them)."""
        origins = self.origins.get("train")
        return self.temperature is not None and origins is not None and sampling_changes(origins, self.temperature)

    def _filter(self, split: str, src: Flat, tgt: Flat, index: np.ndarray | None,
                sizes: tuple[np.ndarray, np.ndarray]) -> TokenizedSplit:
        src_len, tgt_len = (np.asarray(s) if index is None else s[index] for s in sizes)
        long = (src_len > self.max_src_len) | (tgt_len > self.max_tgt_len)
        stats = self.stats[split]
        stats["src_truncated"] = stats["tgt_truncated"] = stats["too_long_dropped"] = 0
        if split == "train" and self.too_long == "drop":
            if len(long) and long.all():  # training would run 0 steps
                raise DataError(f"data.max_src_len={self.max_src_len} / data.max_tgt_len={self.max_tgt_len} "
                                f"(data.too_long=drop) removed all {len(long)} training pairs, each longer in "
                                "subwords on a side; raise the limits or set data.too_long=truncate")
            if long.any():
                keep = np.flatnonzero(~long).astype(np.int32 if len(long) < 2**31 else np.int64)
                index = keep if index is None else index[keep]
            stats["too_long_dropped"] = int(long.sum())
            if long.any():
                log.info("%s: dropped %d of %d pairs longer than %d/%d subwords", split,
                         long.sum(), len(long), self.max_src_len, self.max_tgt_len)
        else:
            stats["src_truncated"] = int((src_len > self.max_src_len).sum())
            stats["tgt_truncated"] = int((tgt_len > self.max_tgt_len).sum())
            if long.any():
                log.info("%s: truncating %d source / %d target sentences to %d/%d subwords "
                         "(model input only)", split, stats["src_truncated"],
                         stats["tgt_truncated"], self.max_src_len, self.max_tgt_len)
        stats["pairs"] = len(src_len) - stats["too_long_dropped"]
        return TokenizedSplit(src, tgt, index, self.max_src_len, self.max_tgt_len, sizes=sizes)

    # -- access ------------------------------------------------------------------------
    def train_rows(self) -> np.ndarray:
        """Rows of the training text that the config trains on (before subword-length limits when
        the training split was read as text only)."""
        self.setup()
        if "train" in self.datasets:
            index = self.datasets["train"].index
            return np.arange(len(self.datasets["train"])) if index is None else np.asarray(index)
        if self._train_text_rows is None:
            raise ValueError("this data module did not read the training split (splits, train_text)")
        return self._train_text_rows

    def raw(self, split: str) -> tuple[list[str], list[str]]:
        """Source and reference strings of `split` in dataset order (batch `ids` index them),
        read from the prepared text (for train this builds every string: inspection only)."""
        if split not in self._raw:
            self.setup()
            index = self.datasets[split].index
            sources, targets = (TextColumn(self.prepared_dir, f"{stored(split)}.{side}").take(index) for side in SIDES)
            self._raw[split] = (sources, self.untagged_targets(targets))
        return self._raw[split]

    @property
    def target_prefixed(self) -> bool:
        """Whether each target starts with its language's code, the decoder's first token
        (`MultilingualSource(target_language="decoder_prefix")`): forced when decoding."""
        return bool(getattr(self.source, "target_prefixed", False))

    def untagged_targets(self, texts: list[str]) -> list[str]:
        """Target texts as they are scored: a source whose targets start with their language's tag
        (`MultilingualSource(target_language="decoder_prefix")`) has it cut; the texts otherwise."""
        untagged = getattr(self.source, "references", None)
        return untagged(texts) if untagged is not None else texts

    def text_lengths(self, split: str, side: str = "src") -> np.ndarray:
        """Lengths of `raw(split)` sentences: source per `src_words` (words | chars), target words."""
        self.setup()
        words = np.load(self.prepared_dir / f"{stored(split)}.{side}.words.npy", mmap_mode="r")
        return words[self.datasets[split].index].astype(np.int64)

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

    def _recount(self, done: int) -> None:
        """The trainer's count of the current epoch's batches done becomes `done` (its ready, started,
        processed and completed counts move alike): after a resume on another number of ranks,
        this rank's share of the epoch's rest is `len(loader) - done` batches."""
        current = self.trainer.fit_loop.epoch_loop.batch_progress.current  # type: ignore[union-attr]
        shift = done - current.processed
        for name in ("ready", "started", "processed", "completed"):
            setattr(current, name, getattr(current, name) + shift)

    def _pin_memory(self) -> bool:
        """Page-locked batches when training on a GPU (copies overlap with compute)."""
        return self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"

    def _workers(self) -> int:
        """DataLoader worker processes: ``num_workers``, or for ``auto`` none on a CPU (the cores
        train) and, on a GPU, up to 4 of this process's share of the cores (one left for it)."""
        if self.num_workers != "auto":
            return int(self.num_workers)
        if not self._pin_memory():
            return 0
        per_process = usable_cores() // max(1, self.trainer.num_devices)
        return max(0, min(4, per_process - 1))

    def _generator(self, rank: int) -> torch.Generator:
        """A DataLoader's own generator, seeded from (seed, rank): its iterators draw from it, not from
        the global torch RNG (with batch samplers of their own, nothing else does)."""
        return torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, rank]).generate_state(1)[0]))

    def _loader(self, dataset: TokenizedSplit, sampler: TokenBatchSampler, rank: int) -> DataLoader:
        workers = self._workers()
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                          num_workers=workers, persistent_workers=workers > 0,
                          pin_memory=self._pin_memory(), generator=self._generator(rank))

    def train_dataloader(self) -> DataLoader:
        self.setup()
        world, rank = self._replicas()
        dataset = self._train_items
        assert self._train_sampler is not None
        varies = "data.augment" if self.augmentation else "data.temperature" if self._sampled() else None
        if varies and self.trainer is not None and self.trainer.reload_dataloaders_every_n_epochs != 1:
            raise ValueError(f"{varies} changes the number of training batches from epoch to epoch: set "
                             "trainer.reload_dataloaders_every_n_epochs=1" +
                             (" (augment=robust sets both)" if self.augmentation else ""))
        sampler = self._train_sampler.replica(world, rank)  # shares the epoch built for `train_padding`
        if self.trainer is not None and self.trainer.overfit_batches > 0:
            sampler.shuffle = False  # epoch 0's batches again in every epoch: the same few to overfit
        if self.trainer is not None:
            sampler.set_epoch(self.trainer.current_epoch)
        workers = self._workers()
        batches = collate_aligned if self.alignment_dir is not None else collate
        return ResumableLoader(dataset, batch_sampler=sampler, collate_fn=functools.partial(batches, shapes=sampler.shapes),
                               num_workers=workers, persistent_workers=workers > 0,
                               pin_memory=self._pin_memory(), generator=self._generator(rank),
                               position=self._position if self.trainer is not None else None,
                               recount=self._recount if self.trainer is not None else None)

    def _eval_loader(self, split: str) -> DataLoader:
        self.setup()
        world, rank = self._replicas()
        dataset = self.datasets[split]
        sampler = TokenBatchSampler(dataset.lengths(), self.eval_max_tokens, self.batch_size,
                                    shuffle=False, num_replicas=world, rank=rank)
        return self._loader(dataset, sampler, rank)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_split)

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
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, generator=self._generator(0))

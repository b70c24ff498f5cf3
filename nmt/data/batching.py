"""Length-bucketed batches: at most `max_tokens` padded tokens, or `batch_size` sentences.

Examples are sorted by source length, then target length (ties broken at random per epoch),
and cut into batches, so a batch holds sentences of similar length on both sides and padding
stays low; the batch order is shuffled per epoch, deterministically from (seed, epoch). Under
DDP each rank takes every `num_replicas`-th batch. `TokenizedSplit` holds a split as flat id arrays and `collate` pads
its examples into the batch dict the models read.
"""

from __future__ import annotations

import copy
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from nmt.data.shapes import ShapeBuckets, bucket
from nmt.data.tokenizer import BOS, EOS, PAD

log = logging.getLogger(__name__)

_EPOCH_FILES = ("order", "bounds", "ids")


def batch_bounds(widths: np.ndarray, max_tokens: int | None, batch_size: int | None) -> np.ndarray:
    """Cut examples of `widths` (N,) (each example's longer side, in batch order) into
    consecutive batches; returns the (num_batches + 1,) int64 bounds: batch b is
    `bounds[b]:bounds[b + 1]`.

    A batch closes when one more example would make `len(batch) * max_len` exceed
    `max_tokens` or the batch would exceed `batch_size` sentences; an example longer than
    `max_tokens` forms a batch of its own. One numpy step per batch, not per example.
    """
    if max_tokens is None and batch_size is None:
        raise ValueError("set max_tokens or batch_size")
    n = len(widths)
    bounds = [0]
    start = 0
    while start < n:
        cap = n - start if batch_size is None else min(n - start, batch_size)
        if max_tokens is not None:  # a batch is at least as wide as its first example
            cap = min(cap, max(1, max_tokens // max(int(widths[start]), 1)))
            padded = np.maximum.accumulate(widths[start : start + cap].astype(np.int64)) * np.arange(1, cap + 1)
            over = np.flatnonzero(padded > max_tokens)
            cap = max(1, int(over[0])) if len(over) else cap
        start += cap
        bounds.append(start)
    return np.array(bounds, dtype=np.int64)


def _columns(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Lengths as (N, sides) integers, uint16 where they fit: (N,) becomes one column."""
    lengths = np.asarray(lengths)
    if not np.issubdtype(lengths.dtype, np.integer):
        lengths = lengths.astype(np.int64)
    if len(lengths) and lengths.dtype != np.uint16 and 0 <= lengths.min() and lengths.max() < 2**16:
        lengths = lengths.astype(np.uint16)
    return lengths[:, None] if lengths.ndim == 1 else lengths


def length_order(lengths: np.ndarray, ties: np.ndarray | None = None) -> np.ndarray:
    """Indices sorting `lengths` (N, sides) by the first column, then the next ones, then by
    `ties` (N,) (else by index): `np.lexsort((ties, *reversed(columns)))`, computed as stable
    sorts from the last key to the first, so that the uint16 length columns get numpy's radix
    sort (3.1 s instead of 6.6 s at 10M examples). int32 when N < 2**31."""
    order = np.arange(len(lengths)) if ties is None else np.argsort(ties, kind="stable")
    for col in reversed(range(lengths.shape[1])):
        order = order[np.argsort(lengths[order, col], kind="stable")]
    return order.astype(np.int32) if len(order) < 2**31 else order


def padding_ratio(batches: Sequence[Sequence[int]], lengths: Sequence[int] | np.ndarray) -> float:
    """Fraction of padded positions in `batches`, each side (column of `lengths`, (N,) or
    (N, sides)) padded to its own longest: 1 - real tokens / padded tokens."""
    lengths = _columns(lengths).astype(np.int64)
    real = padded = 0
    for b in batches:
        lens = lengths[np.asarray(b, dtype=np.int64)]
        real += int(lens.sum())
        padded += len(b) * int(lens.max(0).sum())
    return 1.0 - real / padded if padded else 0.0


class Batch(list):
    """A batch's example indices and the epoch they belong to."""

    def __init__(self, ids: list[int], epoch: int) -> None:
        super().__init__(ids)
        self.epoch = epoch

    def __reduce__(self) -> tuple[Any, ...]:  # to DataLoader workers with its epoch
        return Batch, (list(self), self.epoch)


class TokenBatchSampler(Sampler[list[int]]):
    """Batches of indices for `DataLoader(batch_sampler=...)`.

    lengths: per example length in tokens, specials included: (N,) or (N, 2) source and target
        lengths; examples are sorted by the first column, then the second, and a batch's
        padded size is counted on its longer side.
    max_tokens / batch_size: caps on padded tokens and on sentences per batch (either or both).
    shuffle: training mode (random tie-break and batch order per epoch); otherwise batches come
        sorted by length, every example exactly once.
    num_replicas / rank: DDP. Training pads the batch list by repeating batches from its start
        (or, with `drop_last`, truncates it) so every rank gets the same number of batches;
        evaluation splits the batches without duplicates (ranks may get unequal counts), except that
        fewer batches than ranks are repeated so that every rank has one (a rank without a batch
        would skip validation and leave the others waiting for it).
    The epoch advances after each complete pass or with `set_epoch`; `state_dict` records the
    batches already yielded in the current epoch, by this rank and by all ranks together, so a
    resumed run skips exactly those, on any number of ranks: the epoch's batch list does not
    depend on the ranks, and its rest is split over the ranks of the resumed run (`rank_ids`).
    An epoch is held as numpy arrays (the example order, batch bounds and batch order: ~4 bytes
    per example), built once per epoch; a batch becomes a list only when it is yielded. With
    `share` (a folder), an epoch one process built is saved there and memory-mapped by the
    others with the same lengths and options (DDP ranks), instead of each sorting its own.
    lengths_of_epoch: in training mode, a function giving an epoch's lengths where they change
        from epoch to epoch (augmented pairs, `nmt.data.augment`); batches then come as `Batch`
        lists that carry their epoch, for the dataset to build the same pairs.
    items_of_epoch: in training mode, a function giving the examples of an epoch (indices, an
        example may repeat) where they change from epoch to epoch (pairs sampled by direction,
        `nmt.data.multilingual.temperature_items`); None: every example once.
    shapes: batches cut for `collate`'s shape buckets (`nmt.data.shapes`): a batch's width (both
        sides) is its longest example's length bucket, so a full batch holds `max_tokens // bucket`
        sentences and the full batches of one bucket share one shape. None: exact widths.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, max_tokens: int | None = 4096,
                 batch_size: int | None = None, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0, drop_last: bool = False,
                 share: Path | None = None,
                 lengths_of_epoch: Callable[[int], np.ndarray] | None = None,
                 items_of_epoch: Callable[[int], np.ndarray] | None = None,
                 shapes: ShapeBuckets | None = None) -> None:
        if max_tokens is None and batch_size is None:
            raise ValueError("set max_tokens or batch_size")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        self.lengths = _columns(lengths)
        self.max_tokens, self.batch_size = max_tokens, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        self._yielded = 0   # batches of the current epoch counted as this rank's (the resumed ones included)
        self._resume = (0, 0)  # (batches of all ranks, this rank's count) the next pass starts after
        self._pass = (0, 0)    # the same for the current pass
        self._num_batches: int | None = None
        self._built: dict[str, Any] = {}  # the last epoch built, shared with `replica` copies
        self.share = share
        self.lengths_of_epoch = lengths_of_epoch if shuffle else None
        self.items_of_epoch = items_of_epoch if shuffle else None
        self.shapes = shapes

    def replica(self, num_replicas: int, rank: int) -> TokenBatchSampler:
        """This sampler for one DDP rank, sharing the epochs already built."""
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        other = copy.copy(self)
        other.num_replicas, other.rank, other._num_batches = num_replicas, rank, None
        return other

    def epoch_arrays(self, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order (N,), bounds (B + 1,), batch order (B,)) of `epoch`, before the split over
        ranks: batch k of the epoch is `order[bounds[i]:bounds[i + 1]]` with i = `batch order[k]`."""
        epoch = (self.epoch if epoch is None else epoch) if self.shuffle else 0
        if self._built.get("epoch") != epoch:
            arrays = self._shared(epoch)
            if arrays is None:
                rng = np.random.default_rng([self.seed, epoch])
                lengths = self.lengths if self.lengths_of_epoch is None else _columns(self.lengths_of_epoch(epoch))
                items = None if self.items_of_epoch is None else np.asarray(self.items_of_epoch(epoch))
                lengths = lengths if items is None else lengths[items]
                ties = rng.random(len(lengths)) if self.shuffle else None  # by length, random ties
                order = length_order(lengths, ties)
                widths = lengths.max(1)[order]
                if self.shapes is not None:  # a batch is as wide as its longest example's bucket
                    widths = bucket(widths.astype(np.int64))
                bounds = batch_bounds(widths, self.max_tokens, self.batch_size)
                order = order if items is None else items[order].astype(order.dtype)
                ids = rng.permutation(len(bounds) - 1) if self.shuffle else np.arange(len(bounds) - 1)
                arrays = self._save(epoch, (order, bounds, ids))
            self._built.clear()
            self._built.update(epoch=epoch, arrays=arrays)
        return self._built["arrays"]

    # `share`: a folder where processes with the same data and options (DDP ranks) find an epoch
    # another one built, memory-mapped, instead of each sorting and holding its own copy.
    def _shared(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        folder = None if self.share is None else self.share / f"epoch-{epoch}"
        if folder is None or not (folder / "ids.npy").is_file():
            return None
        return tuple(np.load(folder / f"{name}.npy", mmap_mode="r") for name in _EPOCH_FILES)  # type: ignore[return-value]

    def _save(self, epoch: int, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.share is None:
            return arrays  # type: ignore[return-value]
        try:
            self.share.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=self.share, prefix=".tmp-"))
        except OSError as e:  # a read-only cache: every process keeps its own copy
            log.warning("cannot share the batches of epoch %d in %s: %s", epoch, self.share, e)
            return arrays  # type: ignore[return-value]
        try:
            for name, a in zip(_EPOCH_FILES, arrays):
                np.save(tmp / f"{name}.npy", a)
            tmp.rename(self.share / f"epoch-{epoch}")
        except OSError:  # another process saved it first
            pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for old in self.share.glob("epoch-*"):  # keep this epoch and the one before
            if int(old.name.split("-")[1]) < epoch - 1:
                shutil.rmtree(old, ignore_errors=True)
        return self._shared(epoch) or arrays  # type: ignore[return-value]

    def all_batches(self, epoch: int | None = None) -> list[list[int]]:
        """Every batch of `epoch` in order, before the split over ranks (as lists: small data)."""
        order, bounds, ids = self.epoch_arrays(epoch)
        return [order[bounds[i] : bounds[i + 1]].tolist() for i in ids.tolist()]

    def rank_ids(self, epoch: int | None = None, start: int = 0) -> np.ndarray:
        """Indices into `bounds` of the batches this rank yields in `epoch`, in order: every
        `num_replicas`-th batch of the epoch's list from its batch `start` on (the batches all ranks
        together had trained on before a resume), the list padded with its first batches (or cut)
        to a multiple of `num_replicas`. With the same ranks, `start = k * num_replicas` yields
        exactly the batches after the first k of the whole epoch's split."""
        epoch_ids = self.epoch_arrays(epoch)[2]
        ids = epoch_ids[start:]
        r = self.num_replicas
        if r > 1 and self.shuffle and len(ids):
            if self.drop_last:
                ids = ids[: len(ids) // r * r]
            else:
                ids = np.concatenate([ids, np.resize(epoch_ids, -len(ids) % r)])
        elif r > 1 and 0 < len(ids) < r:  # evaluation: every rank gets a batch (repeated ones are scored once)
            ids = np.resize(ids, r)
        return ids[self.rank :: r]

    def rank_batches(self, epoch: int | None = None) -> list[list[int]]:
        """The batches this rank yields in `epoch` (as lists: small data)."""
        order, bounds, _ = self.epoch_arrays(epoch)
        return [order[bounds[i] : bounds[i + 1]].tolist() for i in self.rank_ids(epoch).tolist()]

    def padding(self) -> float:
        """Padded fraction of an epoch's batches, each side padded to its own longest (or, with
        `shapes`, to its bucket, and the rows to theirs)."""
        real, padded = self.token_counts()
        return 1.0 - real / padded if padded else 0.0

    def token_counts(self, epoch: int | None = None) -> tuple[int, int]:
        """(real, padded) tokens of `epoch`'s batches, both sides together."""
        order = self.epoch_arrays(epoch)[0]
        shapes = self.shapes_of_epoch(epoch)
        return int(self.lengths[order].astype(np.int64).sum()), int((shapes[:, :1] * shapes[:, 1:]).sum())

    def shapes_of_epoch(self, epoch: int | None = None) -> np.ndarray:
        """(B, S[, T]) of every batch of `epoch` as collate pads it: (batches, sides + 1)."""
        order, bounds, _ = self.epoch_arrays(epoch)
        if not len(order):
            return np.zeros((0, 1 + self.lengths.shape[1]), dtype=np.int64)
        rows = np.diff(bounds)
        maxima = [np.maximum.reduceat(self.lengths[order, side].astype(np.int64), bounds[:-1])
                  for side in range(self.lengths.shape[1])]
        if self.shapes is not None and len(maxima) == 2:
            width = bucket(np.maximum(*maxima))
            maxima = [width, width]
            cap = rows if self.shapes.max_tokens is None else np.maximum(rows, self.shapes.max_tokens // width)
            rows = np.minimum(bucket(rows), cap)
        return np.stack([rows, *maxima], axis=1)

    def __len__(self) -> int:
        # the same every epoch (ties only swap equal lengths), unless lengths_of_epoch changes them
        if self._num_batches is None or self.lengths_of_epoch is not None or self.items_of_epoch is not None:
            self._num_batches = len(self.rank_ids())
        return self._num_batches

    @property
    def resume_offset(self) -> int:
        """Batches of its epoch the next pass counts as this rank's already (non-zero only after
        `load_state_dict`): `len(self)` less the batches it yields."""
        return self._resume[1]

    def set_epoch(self, epoch: int) -> None:
        """Use the order of `epoch`; a pending resume offset survives only for the same epoch."""
        if epoch != self.epoch:
            self.epoch, self._yielded = epoch, 0
            self._resume = self._pass = (0, 0)

    def __iter__(self) -> Iterator[list[int]]:
        order, bounds, _ = self.epoch_arrays(self.epoch)
        self._pass, self._resume = self._resume, (0, 0)
        start, self._yielded = self._pass
        for i in self.rank_ids(self.epoch, start).tolist():
            self._yielded += 1
            ids = order[bounds[i] : bounds[i + 1]].tolist()
            yield ids if self.lengths_of_epoch is None else Batch(ids, self.epoch if self.shuffle else 0)
        self.epoch += 1
        self._yielded = 0
        self._pass = (0, 0)

    def global_batches(self, done: int) -> int:
        """Batches of the current epoch's list all ranks together have trained on when this rank
        has done `done` of its `len(self)` (the batches of a resume included): where a resume on
        any number of ranks goes on from."""
        start, counted = self._resume if self._resume != (0, 0) else self._pass  # a resume not yet begun
        return min(start + (done - counted) * self.num_replicas, self.epoch_size())

    def epoch_size(self, epoch: int | None = None) -> int:
        """Batches in `epoch`'s list, before the split over ranks."""
        return len(self.epoch_arrays(epoch)[2])

    def state_dict(self) -> dict[str, Any]:
        """epoch; batches_yielded: this rank's of the epoch; global_batches: all ranks' together;
        num_replicas: how many ranks trained."""
        return {"epoch": self.epoch, "batches_yielded": self._yielded,
                "global_batches": self.global_batches(self._yielded), "num_replicas": self.num_replicas}

    def _saved_start(self, state: dict[str, Any]) -> int:
        """`global_batches` of a saved state; a state saved without it: as many ranks as now."""
        start = state.get("global_batches")
        return int(state["batches_yielded"]) * self.num_replicas if start is None else int(start)

    def rank_done(self, state: dict[str, Any]) -> int:
        """The batches of `state`'s epoch that count as this rank's on resuming from `state`:
        `len(self)` less the batches of the epoch's rest it will yield (`len(self)` when no batch
        is left). Equals the saved `batches_yielded` when the number of ranks is the same."""
        return len(self) - len(self.rank_ids(int(state["epoch"]), self._saved_start(state)))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass continues `state["epoch"]` after the batches all ranks together
        had trained on (`global_batches`), its rest split over this sampler's `num_replicas`
        ranks, whatever number trained before."""
        epoch, start, done = int(state["epoch"]), self._saved_start(state), self.rank_done(state)
        if done >= len(self):  # saved at the very end of an epoch: start the next one
            epoch, start, done = epoch + 1, 0, 0
        self.epoch, self._yielded = epoch, done
        self._resume, self._pass = (start, done), (0, 0)


class TokenizedSplit(Dataset):
    """One split as flat token arrays; item i is (i, source ids, target ids or None).

    src / tgt: (tokens, offsets) with the ids of example j at tokens[offsets[j]:offsets[j+1]]
    (no BOS/EOS); memory-mapped arrays are read only where a batch needs them. index: which
    examples of the arrays the split keeps, in order. sizes: (source, target) subwords per
    example of the arrays when known (else `np.diff(offsets)`). Sides are cut to max_src_len /
    max_tgt_len when given.
    """

    def __init__(self, src: tuple[np.ndarray, np.ndarray], tgt: tuple[np.ndarray, np.ndarray] | None,
                 index: np.ndarray | None = None, max_src_len: int | None = None,
                 max_tgt_len: int | None = None,
                 sizes: tuple[np.ndarray, np.ndarray | None] | None = None) -> None:
        self.src, self.tgt = src, tgt
        self._index = None if index is None else np.asarray(index)  # None: every example, in order
        self._len = len(src[1]) - 1 if index is None else len(self._index)
        self.max_src_len, self.max_tgt_len = max_src_len, max_tgt_len
        self.sizes = sizes

    @property
    def index(self) -> np.ndarray:
        return np.arange(self._len) if self._index is None else self._index

    def __len__(self) -> int:
        return self._len

    @staticmethod
    def _side(side: tuple[np.ndarray, np.ndarray], j: int, limit: int | None) -> np.ndarray:
        tokens, offsets = side
        start, end = int(offsets[j]), int(offsets[j + 1])
        return np.asarray(tokens[start : end if limit is None else min(end, start + limit)])

    def __getitem__(self, i: int) -> tuple[int, np.ndarray, np.ndarray | None]:
        j = i if self._index is None else int(self._index[i])
        tgt = None if self.tgt is None else self._side(self.tgt, j, self.max_tgt_len)
        return i, self._side(self.src, j, self.max_src_len), tgt

    def __getitems__(self, indices: list[int]) -> list[tuple[int, np.ndarray, np.ndarray | None]]:
        return [self[i] for i in indices]

    def lengths(self) -> np.ndarray:
        """Per example (source, target) lengths with EOS/BOS, after truncation: (N, 2), or (N, 1)
        without targets; uint16 under limits below 65,535, else int64."""
        def side(k: int, s: tuple[np.ndarray, np.ndarray], limit: int | None) -> np.ndarray:
            n = np.diff(s[1]) if self.sizes is None else self.sizes[k]
            n = n if self._index is None else n[self._index]
            if limit is not None and limit < 2**16 - 1:
                return (np.minimum(n, limit) + 1).astype(np.uint16)
            return n.astype(np.int64) + 1

        sides = [side(0, self.src, self.max_src_len)]
        if self.tgt is not None:
            sides.append(side(1, self.tgt, self.max_tgt_len))
        return np.stack(sides, axis=1) if len({a.dtype for a in sides}) == 1 else np.stack(sides, axis=1).astype(np.int64)


def _pad(rows: list[np.ndarray], first: int | None, last: int | None,
         width: int | None = None) -> tuple[torch.Tensor, int]:
    """(B, L) int64 of rows with an optional first/last id, padded with PAD to their longest (or
    to ``width``); and the token count."""
    lens = [len(r) + (first is not None) + (last is not None) for r in rows]
    out = np.full((len(rows), max(lens) if width is None else width), PAD, dtype=np.int64)
    shift = int(first is not None)
    for b, r in enumerate(rows):
        if first is not None:
            out[b, 0] = first
        out[b, shift : shift + len(r)] = r
        if last is not None:
            out[b, shift + len(r)] = last
    return torch.from_numpy(out), sum(lens)


FILLER = np.zeros(0, dtype=np.int64)  # a filler row's sentence: EOS alone (source), BOS then padding (target)


def collate(items: list[tuple[int, np.ndarray, np.ndarray | None]], shapes: ShapeBuckets | None = None) -> dict[str, Any]:
    """A batch dict: src (B, S) ids+EOS, src_mask (B, S), tgt_in (B, T) BOS+ids,
    tgt_out (B, T) ids+EOS, ids (B,), num_src_tokens, num_tgt_tokens; no tgt keys without targets.

    ``shapes`` (training batches with targets): S and T padded to one length, the bucket of the
    longer, and B to its row bucket with filler rows (id -1, ``tgt_out`` all PAD: no target the loss counts);
    ``num_*_tokens`` count the real sentences' tokens only."""
    srcs = [s for _, s, _ in items]
    ids = [i for i, _, _ in items]
    tgts = [t for _, _, t in items] if items and items[0][2] is not None else None
    src_width = tgt_width = None
    if shapes is not None and tgts is not None:  # both sides to one length: few shapes, each its rows
        src_width = tgt_width = shapes.length(max(max(len(s) for s in srcs), max(len(t) for t in tgts)) + 1)
        fill = shapes.rows(len(items), src_width) - len(items)
        srcs, tgts, ids = srcs + [FILLER] * fill, tgts + [FILLER] * fill, ids + [-1] * fill
    src, num_src = _pad(srcs, None, EOS, src_width)
    batch: dict[str, Any] = {"src": src, "src_mask": src != PAD, "ids": torch.tensor(ids, dtype=torch.long),
                             "num_src_tokens": num_src - (len(srcs) - len(items))}
    if tgts is not None:
        batch["tgt_in"], num_tgt = _pad(tgts, BOS, None, tgt_width)
        batch["tgt_out"], _ = _pad(tgts, None, EOS, tgt_width)
        filler = torch.arange(len(tgts)) >= len(items)
        batch["tgt_out"][filler] = PAD
        batch["num_tgt_tokens"] = num_tgt - (len(tgts) - len(items))
    return batch

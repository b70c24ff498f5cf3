"""A bounded set of batch shapes: training batches padded to a few lengths and row counts, so a
compiled graph (``torch.compile``) or a captured CUDA graph made for one shape is reused by every
batch of that shape instead of being made anew for each batch.

``data.shapes``: ``exact`` pads a batch to its own longest sentence, as always; ``buckets`` pads
both sides to one length, the ladder value (``ladder_values``) at or above the batch's longest
sentence on either side, and the number of sentences up to the next ladder value (capped at what
``max_tokens`` allows at that length, so a padded batch never holds more tokens than an exact one
could); ``auto`` is ``buckets`` when training on a GPU and ``exact`` elsewhere (a CPU runs eager
and gains nothing from equal shapes). The added rows are filler sentences (source EOS, target all
padding) that the loss never sees. One length for both sides keeps an epoch's shapes to a few
dozen (padding each side to its own bucket pairs the lengths into hundreds on long-sentence
corpora); ``scripts/benchmark_shapes.py`` measures both counts and the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHAPES = ("auto", "exact", "buckets")
STEP = 4  # every bucket from here is a multiple of this, up to ...
LINEAR_UP_TO = 64  # ... here; beyond it buckets grow by GROWTH each (so padding adds at most ~12.5%)
GROWTH = 1.125


def ladder_values(limit: int) -> np.ndarray:
    """The buckets up to the first one at least ``limit``: 1 to ``STEP`` (small batches), multiples
    of ``STEP`` to ``LINEAR_UP_TO``, then steps of ``GROWTH`` rounded up to a multiple of ``STEP``:
    42 buckets up to 1,132."""
    values = list(range(1, STEP))
    value = STEP
    while True:
        values.append(value)
        if value >= limit:
            return np.array(values, dtype=np.int64)
        value = value + STEP if value < LINEAR_UP_TO else -(-int(np.ceil(value * GROWTH)) // STEP) * STEP


def bucket(n: int | np.ndarray, limit: int | None = None) -> np.ndarray | int:
    """The smallest ladder value at least ``n`` (elementwise for arrays)."""
    top = int(np.max(n)) if np.size(n) else 1
    values = ladder_values(max(top, limit or 1))
    out = values[np.searchsorted(values, n)]
    return int(out) if np.ndim(n) == 0 else out


@dataclass(frozen=True)
class ShapeBuckets:
    """How ``collate`` pads a training batch: each side's length to its bucket, the rows to theirs
    (at most ``max_tokens // padded width`` rows; a batch of one sentence longer than max_tokens
    keeps its one row)."""

    max_tokens: int | None

    def length(self, n: int) -> int:
        return int(bucket(n))

    def rows(self, rows: int, width: int) -> int:
        padded = int(bucket(rows))
        if self.max_tokens is not None:
            padded = min(padded, max(rows, self.max_tokens // max(width, 1)))
        return padded


def resolve_shapes(shapes: str, device: str) -> str:
    """``data.shapes`` for a run on ``device`` (cpu, cuda, ...): ``auto`` becomes ``buckets`` on a
    GPU and ``exact`` elsewhere."""
    if shapes not in SHAPES:
        raise ValueError(f"data.shapes={shapes}: choose {', '.join(SHAPES)}")
    if shapes == "auto":
        return "buckets" if device == "cuda" else "exact"
    return shapes

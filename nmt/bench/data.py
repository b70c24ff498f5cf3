"""What ``scripts/benchmark_data.py`` runs in other processes: the callback that ``train.py`` builds
from its ``_target_`` to stamp the first training step, and the batch-sampler benchmark, run in a
fresh process so that its peak memory is its own."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import numpy as np


def first_step(path: str):
    """A Lightning callback that writes the wall-clock time of the first training batch to `path`
    (`+callbacks.first_step._target_=nmt.bench.data.first_step`); Lightning is imported only here."""
    from pytorch_lightning import Callback

    class FirstStep(Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step == 0 and trainer.global_rank == 0 and not os.path.exists(path):
                Path(path).write_text(f"{time.time()}\n")

    return FirstStep()


def bench_sampler(pairs: int) -> dict:
    """Build one training epoch of batches over `pairs` random (source, target) lengths."""
    from nmt.data.batching import TokenBatchSampler

    rng = np.random.default_rng(0)
    src = np.clip(rng.lognormal(np.log(30), 0.6, pairs), 2, 257).astype(np.int32)
    lengths = np.stack([src, np.clip(src + rng.integers(-5, 6, pairs), 2, 257).astype(np.int32)], axis=1)
    del src
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    sampler = TokenBatchSampler(lengths, max_tokens=4096, seed=0)
    order, bounds, ids = sampler.epoch_arrays(0)
    seconds = time.perf_counter() - start
    first = next(iter(sampler))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"pairs": pairs, "batches": len(ids), "build_seconds": round(seconds, 1),
            "lengths_gb": round(lengths.nbytes / 2**30, 2), "peak_above_lengths_gb": round((peak - before) / 2**30, 2),
            "first_batch": len(first)}

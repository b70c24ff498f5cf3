"""Intra-op threads that follow the load of a shared CPU.

torch's OpenMP threads spin at every barrier. When another CPU-bound process holds one of a
2-core machine's cores, the thread that waits burns the time the other needs, and training runs
at about 30% of its quiet speed instead of the half a fair share would give
(``scripts/benchmark_contention.py``). ``CpuThreads`` watches how many cores other processes
keep busy (``/proc/stat`` less this process's own time) and, every ``every_n_steps`` steps, sets
torch's thread count to the cores left, between 1 and the count it started with: beside one
competitor a 2-thread run trains on one thread, and when the competitor is gone it goes back to
two. Validation and test decoding follow the load the same way, batch by batch. Quiet, nothing
changes. It acts only where it can measure (Linux), on a CPU in one process, and when torch has
at least two threads.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytorch_lightning as L
import torch
from pytorch_lightning.callbacks import Callback

log = logging.getLogger(__name__)


def cpu_times() -> tuple[int, int, int] | None:
    """(busy, total) clock ticks of all CPUs (``/proc/stat``) and this process's own ticks
    (``/proc/self/stat``: user + system time of all its threads); None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait, int(own[11]) + int(own[12])  # utime, stime (fields 14, 15)


def others_busy(before: tuple[int, int, int], after: tuple[int, int, int], cpus: int) -> float:
    """Cores that other processes kept busy between two ``cpu_times`` samples."""
    busy, total, own = (b - a for a, b in zip(before, after))
    return max(busy - own, 0) / total * cpus if total > 0 else 0.0


def threads_for(others: float, cpus: int, most: int) -> int:
    """Threads that fit in the cores the other processes leave (rounded), from 1 to ``most``."""
    return max(1, min(most, round(cpus - others)))


class CpuThreads(Callback):
    """Sets torch's intra-op thread count to the cores other processes leave free (see the
    module): every ``every_n_steps`` training steps, and after every validation and test batch
    (decoding a batch takes several steps' time); back to the starting count at the end."""

    def __init__(self, every_n_steps: int = 5) -> None:
        self.every = max(1, every_n_steps)
        self.enabled = False
        self.most: int | None = None

    def _start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.most is None:
            self.most = torch.get_num_threads()
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.last = cpu_times()
        self.enabled = (self.last is not None and self.most > 1 and trainer.world_size == 1
                        and pl_module.device.type == "cpu")

    def _adapt(self) -> None:
        now = cpu_times()
        if now is None:
            return
        others, self.last = others_busy(self.last, now, self.cpus), now
        threads = threads_for(others, self.cpus, self.most)
        if threads != torch.get_num_threads():
            log.info("other processes keep %.1f of %d cores busy: running on %d thread(s)", others, self.cpus, threads)
            torch.set_num_threads(threads)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(trainer, pl_module)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled:  # after training: the load since its last look sets the test's threads
            self._adapt()
        else:
            self._start(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.enabled and trainer.global_step % self.every == 0:
            self._adapt()

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.enabled:
            self._adapt()

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.enabled:
            self._adapt()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.most is not None and torch.get_num_threads() != self.most:
            torch.set_num_threads(self.most)  # the process (a sweep's next run, the test) starts from the full count

"""Intra-op threads that follow the load of a shared CPU.

torch's OpenMP threads spin at every barrier. When another CPU-bound process holds one of a
2-core machine's cores, the thread that waits burns the time the other needs, and training runs
at about 30% of its quiet speed instead of the share one core gives (``scripts/benchmark_contention.py``).
``CpuThreads`` looks, every ``interval_s`` seconds (checked at each batch end), at how many cores
other processes keep busy (``/proc/stat`` less this process's own time) and sets torch's thread
count to the cores left, between 1 and the count it started with.

The thread count is not a knife edge: with two spinning threads a competitor gets only part of a
core, so a drop is due as soon as others take more than half a core beyond the cores not ours
(``threads_for``), and a rise only once they leave most of a core free again. A change needs
``patience`` looks in a row that agree (the first look of a run acts alone), so a competitor
that comes and goes every few seconds does not flip the count at every look. The first change is
logged; later ones are counted, and the time spent on each thread count goes into the run summary
(``summary()``). Validation and test decoding follow the load the same way. Quiet, nothing
changes. It acts only where it can measure (Linux), on a CPU in one process, and when torch has at
least two threads.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import pytorch_lightning as L
import torch
from pytorch_lightning.callbacks import Callback

from nmt.machine import affinity_cores

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


def threads_for(others: float, cpus: int, most: int, current: int) -> int:
    """The thread count for ``others`` busy cores, from ``current`` threads: fewer once others take
    more than half a core of ours (cores free below ``current - 0.5``), more only once at least
    ``current + 0.75`` cores are free; between 1 and ``most``."""
    free = cpus - others
    if free < current - 0.5:
        return max(1, min(most, math.floor(free + 0.5)))
    if free >= current + 0.75:
        return max(1, min(most, math.floor(free + 0.25)))
    return max(1, min(most, current))


class CpuThreads(Callback):
    """Sets torch's intra-op thread count to the cores other processes leave free (see the
    module): at most every ``interval_s`` seconds, looked at after each training, validation and
    test batch; a change once ``patience`` looks in a row ask for it; back to the starting count
    at the end."""

    def __init__(self, interval_s: float = 0.5, patience: int = 2) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0 \
                or not math.isfinite(interval_s):
            raise ValueError(f"callbacks.cpu_threads.interval_s={interval_s!r}: a positive number of seconds")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"callbacks.cpu_threads.patience={patience!r}: a whole number of looks, at least 1")
        self.interval, self.patience = float(interval_s), int(patience)
        self.enabled = False
        self.most: int | None = None
        self.seconds: dict[int, float] = {}  # thread count -> seconds spent on it
        self.changes = 0
        self.looks = 0
        self._wanted: tuple[int, int] | None = None  # (thread count asked for, looks in a row)

    def _start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.most is None:
            self.most = torch.get_num_threads()
        self.cpus = affinity_cores()  # the busy share of /proc/stat is counted in these
        self.last = cpu_times()
        self.since = self.changed_at = time.monotonic()
        self.enabled = (self.last is not None and self.most > 1 and trainer.world_size == 1
                        and pl_module.device.type == "cpu")

    def _look(self) -> None:
        """Adapt when ``interval_s`` has passed since the last look."""
        if time.monotonic() - self.since >= self.interval:
            self._adapt()

    def _adapt(self) -> None:
        now = cpu_times()
        if now is None:
            return
        self.since = time.monotonic()
        others, self.last = others_busy(self.last, now, self.cpus), now
        self.looks += 1
        current = torch.get_num_threads()
        wanted = threads_for(others, self.cpus, self.most, current)
        if wanted == current:
            self._wanted = None
            return
        asked = self._wanted[1] + 1 if self._wanted is not None and self._wanted[0] == wanted else 1
        self._wanted = (wanted, asked)
        if asked >= self.patience or self.looks == 1:
            self._set(wanted, others)

    def _set(self, threads: int, others: float) -> None:
        self._account()
        self.changes += 1
        self._wanted = None
        if self.changes == 1:
            log.info("other processes keep %.1f of %d cores busy: running on %d thread(s) while they do (later "
                     "changes are counted in the run summary, cpu_threads)", others, self.cpus, threads)
        else:
            log.debug("other processes keep %.1f of %d cores busy: running on %d thread(s)", others, self.cpus, threads)
        torch.set_num_threads(threads)

    def _account(self) -> None:
        now = time.monotonic()
        threads = torch.get_num_threads()
        self.seconds[threads] = self.seconds.get(threads, 0.0) + now - self.changed_at
        self.changed_at = now

    def summary(self) -> dict[str, Any] | None:
        """Seconds on each thread count and the number of changes (None where it did not act)."""
        if self.most is None or not self.seconds and not self.enabled:
            return None
        return {"started_with": self.most, "changes": self.changes,
                "seconds_by_threads": {str(k): round(v, 1) for k, v in sorted(self.seconds.items())}}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(trainer, pl_module)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled:  # after training: the load since its last look sets the test's threads
            self._adapt()
        else:
            self._start(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.enabled:
            self._look()

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.enabled:
            self._look()

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.enabled:
            self._look()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report()

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report()

    def _report(self) -> None:
        if not self.enabled:
            return
        self._account()
        if self.changes:
            total = sum(self.seconds.values()) or 1.0
            shares = ", ".join(f"{100 * s / total:.0f}% on {k} thread(s)" for k, s in sorted(self.seconds.items()))
            log.info("cpu_threads: %s (%d change(s) of the thread count)", shares, self.changes)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.enabled:
            self._account()  # the time until now on the thread count in force
        if self.most is not None and torch.get_num_threads() != self.most:
            torch.set_num_threads(self.most)  # the process (a sweep's next run, the test) starts from the full count

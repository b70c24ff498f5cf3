"""Progress as log lines, for output that is not a terminal (a file, a pipe, a batch job's log),
where a progress bar draws nothing until the run ends.

Every ``every_n_steps`` optimizer steps, one line on the run's logger (the console and
``train.log``)::

    step 250/1,750 (14%): loss 2.412 (nll 1.873), 10,240 tokens/s, lr 2.0e-03, 0:00:58 in, 0:05:49 left

``loss`` is the training objective (label-smoothed cross-entropy per target token) and ``nll`` the
plain negative log-likelihood (``train/nll``, which ``val/nll`` compares with), both the mean over
the steps since the last line; tokens/s counts source and target tokens of every process; the
time left is ``nmt.training.callbacks.run_eta``'s (the budget's steps left at the pace so far, or
what ``max_time`` leaves). ``when``: ``auto`` (only where the standard output is not a terminal;
a terminal has the progress bar), ``always`` or ``never``.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import pytorch_lightning as L
from pytorch_lightning.callbacks import Callback

from nmt.training.callbacks import hms, last_step, run_eta

log = logging.getLogger(__name__)

WHEN = ("auto", "always", "never")


def output_is_terminal() -> bool:
    """Whether the standard output is a terminal (where a progress bar redraws itself)."""
    return sys.stdout.isatty()


class ProgressLines(Callback):
    """A log line every ``every_n_steps`` optimizer steps on global rank 0 (see the module's docstring)."""

    def __init__(self, every_n_steps: int = 50, when: str = "auto") -> None:
        if when not in WHEN:
            raise ValueError(f"callbacks.progress_lines.when={when!r}: choose one of {', '.join(WHEN)}")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"callbacks.progress_lines.every_n_steps={every_n_steps!r}: a whole number of "
                             "optimizer steps, at least 1")
        self.every = every_n_steps
        self.active = when == "always" or (when == "auto" and not output_is_terminal())
        self._reset_window(None)
        self._started: float | None = None
        self._first_step = 0
        self._logged_step: int | None = None

    def _reset_window(self, module: L.LightningModule | None) -> None:
        self._losses: list[float] = []
        self._nlls: list[float] = []
        self._tokens = float(getattr(module, "train_tokens", 0) or 0)
        self._seconds = float(getattr(module, "train_seconds", 0.0) or 0.0)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started, self._first_step = time.monotonic(), trainer.global_step
        self._reset_window(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.active or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        for name, values in (("train/loss", self._losses), ("train/nll", self._nlls)):
            if name in metrics:
                values.append(float(metrics[name]))
        step = trainer.global_step
        if step % self.every or step == self._logged_step or step == self._first_step:
            return
        self._logged_step = step
        log.info("%s", self.line(trainer, pl_module))
        self._reset_window(pl_module)

    def line(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        step = trainer.global_step
        end = last_step(trainer)
        parts = [f"step {step:,}" + (f"/{int(end):,} ({100 * step / end:.0f}%)" if end else "")]
        if self._losses:
            loss = f"loss {sum(self._losses) / len(self._losses):.3f}"
            if self._nlls:
                loss += f" (nll {sum(self._nlls) / len(self._nlls):.3f})"
            parts.append(loss)
        tokens = float(getattr(pl_module, "train_tokens", 0) or 0) - self._tokens
        seconds = float(getattr(pl_module, "train_seconds", 0.0) or 0.0) - self._seconds
        if tokens > 0 and seconds > 0:
            parts.append(f"{tokens * trainer.world_size / seconds:,.0f} tokens/s")
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.1e}")
        elapsed = time.monotonic() - (self._started or time.monotonic())
        timing = f"{hms(elapsed)} in"
        eta = run_eta(trainer, elapsed, step - self._first_step)
        if eta is not None:
            timing += f", {hms(eta)} left"
        parts.append(timing)
        return ": ".join([parts[0], ", ".join(parts[1:])])

"""Callbacks of our own; the rest of ``nmt/conf/callbacks/`` are Lightning's."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as L
import torch
from lightning_fabric.plugins import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback, EMAWeightAveraging, RichProgressBar, Timer
from pytorch_lightning.utilities.exceptions import SIGTERMException

from nmt.checkpoints.files import atomic_save, read_checkpoint
from nmt.training.schedules import WarmupCosine

log = logging.getLogger(__name__)


class LastCheckpoint(Callback):
    """The one writer of ``<dirpath>/<filename>.ckpt``: what a resumed run starts from, and the
    final weights whenever training ends, so the weights a run tests and reports are on disk.

    It saves every ``every_n_train_steps`` optimizer steps, after each validation, and at the
    end: a stop by ``max_steps`` or ``max_time`` at the end of the batch that reaches it, as a
    step checkpoint does (its loops say "in the middle of the epoch", so a resume goes on from the
    next batch; saved after the fit the epoch would read as done and its rest be skipped); an end
    of epoch (``max_epochs``, early stopping there) in ``on_train_end``; both before testing.
    ``ModelCheckpoint`` callbacks keep their top-k files but must not write ``last.ckpt``
    (``save_last: false``): Lightning's rewrites it after the fit, as a finished epoch.

    SIGTERM: Lightning's handler sets ``trainer.received_sigterm`` and its loops raise
    ``SIGTERMException`` at the next safe point (after the running training batch, and after the
    validation that is due then; or after the running validation batch); this callback saves in
    ``on_exception``, so the checkpoint holds the state after that batch, data position included.
    ``signals`` (default SIGUSR1, SIGUSR2: SLURM's ``--signal``, submitit) take the same path,
    unless another handler already owns them (Lightning's SLURM auto-requeue handles SIGUSR1).
    ``signal`` holds the signal that stopped training, for ``train()`` to report and exit with;
    ``path``/``step`` what was saved last. Place it before a weight-averaging callback, whose
    ``on_train_end`` replaces the weights.
    """

    def __init__(self, dirpath: str, filename: str = "last", every_n_train_steps: int | None = 200,
                 signals: Sequence[str] = ("SIGUSR1", "SIGUSR2")) -> None:
        self.path = Path(dirpath) / f"{filename}.ckpt"
        self.every = every_n_train_steps
        self.signals = [getattr(signal, name) for name in signals]
        self.signal: int | None = None
        self.step: int | None = None  # the global step of the checkpoint saved last
        self._previous: dict[int, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            if signal.getsignal(signum) in (signal.SIG_DFL, None):
                self._previous[signum] = signal.signal(signum, self._forward)

    def _forward(self, signum: int, frame: Any) -> None:
        """Handle a SLURM signal as SIGTERM: Lightning's handler (installed for the fit) sets the flag."""
        log.info("received %s", signal.Signals(signum).name)
        self.signal = signum
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):
            handler(signum, frame)

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _save(self, trainer: L.Trainer) -> None:
        trainer.save_checkpoint(self.path, weights_only=False)  # optimizer and loops too: a run resumes from it
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Every ``every_n_train_steps`` steps; and when training ends after this batch, because it
        reached ``max_steps`` or the time budget is spent. The time is read on rank 0 and broadcast
        (as Lightning's Timer does after this hook), so every rank saves or none does."""
        step = trainer.global_step
        at_max_steps = 0 < trainer.max_steps <= step
        remaining = time_left(trainer)
        time_up = remaining is not None and trainer.strategy.broadcast(remaining <= 0)
        if time_up or at_max_steps:
            # what the Timer decides next, decided once; and the loop then validates these final
            # weights on the set the other checkpoints were scored on, so they compete for "best"
            trainer.should_stop = True
        due = bool(self.every) and step > 0 and step % self.every == 0
        if (at_max_steps or time_up or due) and self.step != step:
            self._save(trainer)
            if at_max_steps or time_up:
                log.info("training ends at step %d (%s); final weights in %s", step,
                         "max_steps" if at_max_steps else "max_time", self.path)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking and self.step != trainer.global_step:
            self._save(trainer)

    def _save_stopped(self, trainer: L.Trainer) -> None:
        self.signal = self.signal or signal.SIGTERM
        self._save(trainer)
        log.warning("stopped by %s at step %d (epoch %d); saved %s; resume with ckpt_path=%s",
                    signal.Signals(self.signal).name, trainer.global_step, trainer.current_epoch, self.path, self.path)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_handlers()
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":
            self._save_stopped(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Also a signal during the last batch ends the fit normally: save, and report it."""
        self._restore_handlers()
        if trainer.received_sigterm:
            self._save_stopped(trainer)
        elif self.step != trainer.global_step:
            self._save(trainer)
            log.info("training ended at step %d after %d epochs; final weights in %s",
                     trainer.global_step, trainer.current_epoch, self.path)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handlers()


class RecentCheckpoints(Callback):
    """Every ``every_n_train_steps`` optimizer steps save the weights (no optimizer state) as
    ``<dirpath>/step<step>.ckpt`` and keep the newest ``keep`` of them: what ``nmt-average last=N``
    averages."""

    def __init__(self, dirpath: str, every_n_train_steps: int = 200, keep: int = 5) -> None:
        if every_n_train_steps < 1 or keep < 1:
            raise ValueError(f"RecentCheckpoints: every_n_train_steps={every_n_train_steps} and keep={keep} "
                             "must be at least 1")
        self.dirpath, self.every, self.keep = Path(dirpath), every_n_train_steps, keep
        self._saved_step: int | None = None  # known on every rank alike (a save is collective)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every or step == self._saved_step:  # accumulating: same step again
            return
        trainer.save_checkpoint(self.dirpath / f"step{step:06d}.ckpt", weights_only=True)
        self._saved_step = step
        if trainer.is_global_zero:
            kept = sorted(self.dirpath.glob("step*.ckpt"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else -1)
            for old in kept[: -self.keep]:
                old.unlink()


class EMA(EMAWeightAveraging):
    """An exponential moving average of the weights (``callbacks=[default,ema]``): Lightning's
    ``EMAWeightAveraging``, which validates with the averaged weights, saves them as a
    checkpoint's ``state_dict`` (the raw weights as ``current_model_state``) and ends training
    with them. Changes:

    - before its first update (``update_starting_at_step``) there is no average: validation,
      checkpoints and the end of training use the raw weights (Lightning's would use the
      weights the model started from);
    - a checkpoint saved while validation holds the averaged weights (a signal in validation)
      still stores the average as ``state_dict`` and the raw weights as ``current_model_state``;
    - checkpoints saved after training ended (the final ``last.ckpt``) keep the raw weights as
      ``current_model_state``, so a resumed run goes on training those, not the average;
    - testing or validating a checkpoint outside ``fit`` keeps its averaged weights (Lightning's
      callback would load the raw ones).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._raw_final: dict[str, Any] | None = None
        self._swapped = False

    def _averaged(self) -> bool:
        return self._average_model is not None and int(self._average_model.n_averaged) > 0

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._averaged():
            super().on_validation_epoch_start(trainer, pl_module)
            self._swapped = True

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._swapped:
            super().on_validation_epoch_end(trainer, pl_module)
            self._swapped = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._averaged():
            self._raw_final = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            super().on_train_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if not self._averaged():
            return
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._swapped:  # the module holds the average, the averaged model the raw weights
            checkpoint["state_dict"], checkpoint["current_model_state"] = (checkpoint["current_model_state"],
                                                                          checkpoint["state_dict"])
        elif self._raw_final is not None:
            checkpoint["current_model_state"] = self._raw_final

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == "fit":
            super().on_load_checkpoint(trainer, pl_module, checkpoint)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._raw_final = None


def budget_timer(trainer: L.Trainer) -> Timer | None:
    """Lightning's Timer, which ``max_time`` adds (its times include the runs a run resumed from)."""
    return next((c for c in trainer.callbacks if isinstance(c, Timer)), None)


def time_left(trainer: L.Trainer) -> float | None:
    """Seconds of ``max_time`` left for training; None without a time budget."""
    timer = budget_timer(trainer)
    return timer.time_remaining("train") if timer is not None else None


def last_step(trainer: L.Trainer) -> float | None:
    """The step training ends at by ``max_steps``, or by ``max_epochs`` of this epoch's length;
    None when neither is known."""
    if trainer.max_steps and trainer.max_steps > 0:
        return trainer.max_steps
    if trainer.max_epochs and trainer.max_epochs > 0 and math.isfinite(trainer.num_training_batches):
        return trainer.num_training_batches / trainer.accumulate_grad_batches * trainer.max_epochs
    return None


def run_eta(trainer: L.Trainer, seconds: float, steps: int) -> float | None:
    """Seconds the run has left: the smaller of what ``max_time`` leaves and what the steps left
    (``max_steps``, or ``max_epochs`` of this epoch's length) take at the pace of ``steps`` steps
    in ``seconds``; None when neither is known."""
    budget = time_left(trainer)
    end = last_step(trainer)
    left = max(end - trainer.global_step, 0) * seconds / steps if steps > 0 and end is not None else None
    known = [t for t in (budget, left) if t is not None]
    return max(min(known), 0.0) if known else None  # a spent budget leaves 0, never a negative time


def ended_by(trainer: L.Trainer) -> str:
    """What ended training: ``max_steps`` (the budget), ``max_time`` (the safety net, before the
    budget), ``pruned`` (a sweep's pruner, ``nmt.training.sweep_pruning``), ``early_stopping`` or
    ``max_epochs``."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return "max_steps"
    budget = time_left(trainer)
    if budget is not None and budget <= 0:
        return "max_time"
    if any(getattr(cb, "pruned_at", None) is not None for cb in trainer.callbacks):
        return "pruned"
    if trainer.should_stop:
        return "early_stopping"
    return "max_epochs"


def hms(seconds: float) -> str:
    """``H:MM:SS`` of a non-negative duration, hours past 24 included (``time.strftime`` wraps them)."""
    minutes, secs = divmod(int(round(max(seconds, 0.0))), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def share_best_with_last(best: str | Path | None, last: LastCheckpoint | None) -> bool:
    """Where the best checkpoint holds the final state (the same step and the same weights as
    ``last.ckpt``: the last validation was the best), the best file becomes a second name of
    ``last.ckpt`` (a hard link), so a run keeps one copy of the weights, not two. ``last.ckpt`` is
    the one to keep: saved at the end of the batch, it resumes exactly (``LastCheckpoint``); the
    best file's own callback state, saved after the validation, is the only thing dropped. A
    later save of ``last.ckpt`` (a resumed run) writes a new file renamed over it, which leaves
    the best file as it was. False where the files differ or the folder takes no hard links (both
    copies stay)."""
    if not best or last is None or last.step is None or not last.path.is_file() or not Path(best).is_file():
        return False
    best = Path(best)
    if best.samefile(last.path):
        return True
    a, b = read_checkpoint(best), read_checkpoint(last.path)
    if a.get("global_step") != b.get("global_step") or a["state_dict"].keys() != b["state_dict"].keys() or \
            not all(torch.equal(t, b["state_dict"][name]) for name, t in a["state_dict"].items()):
        return False
    del a, b
    link = best.with_name(best.name + ".link")
    try:
        os.link(last.path, link)
        os.replace(link, best)
    except OSError as e:
        link.unlink(missing_ok=True)
        log.info("the best checkpoint is the final state, but %s cannot be a hard link of %s (%s): both copies "
                 "are kept", best, last.path, e)
        return False
    log.info("the best checkpoint is the final state: %s is now a second name of %s (one copy on disk)",
             best.name, last.path.name)
    return True


class ScheduleHorizon(Callback):
    """Ends a learning-rate decay where the run ends: for a schedule whose horizon is the run's
    budget (``scheduler=cosine`` with ``trainer.max_steps=-1``: ``WarmupCosine.from_budget``), sets
    ``total_steps`` to the smaller of the last step of ``max_epochs`` and the step at which
    ``max_time`` is spent at the pace of the run so far (validation included), re-estimated every
    ``every_n_steps`` steps; a resumed run starts from the pace its restored time budget and step
    give. Rank 0's estimate is broadcast, so every rank follows the same schedule. Without a time
    budget or a step/epoch limit there is no horizon, and training does not start."""

    def __init__(self, every_n_steps: int = 10) -> None:
        self.every = max(1, every_n_steps)
        self._schedules: list[WarmupCosine] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._schedules = [config.scheduler for config in trainer.lr_scheduler_configs
                           if isinstance(config.scheduler, WarmupCosine) and config.scheduler.from_budget]
        if not self._schedules:
            return
        end, budget = last_step(trainer), time_left(trainer)
        if end is None and budget is None:
            raise ValueError("scheduler.total_steps is not set and the run has no trainer.max_steps, max_epochs "
                             "or max_time for the learning-rate decay to end at: set one of them")
        self._started, self._first_step = time.monotonic(), trainer.global_step
        spent = budget_timer(trainer).time_elapsed("train") if budget is not None else 0.0
        if budget is None or (trainer.global_step > 0 and spent > 0):  # epochs only, or resumed: the pace so far
            self._estimate(trainer, trainer.global_step / spent if spent > 0 else 0.0)
        if budget is None:
            log.info("the learning-rate decay ends at step %d (max_epochs)", int(end))
        else:
            log.info("the learning-rate decay ends as max_time runs out, at the pace so far (re-estimated every %d "
                     "steps)", self.every)

    def _estimate(self, trainer: L.Trainer, pace: float) -> None:
        """The horizon at ``pace`` steps per second, rank 0's on every rank."""
        budget = time_left(trainer)
        ends = [last_step(trainer), trainer.global_step + max(budget, 0.0) * pace if budget is not None else None]
        horizon = trainer.strategy.broadcast(int(min(e for e in ends if e is not None)), src=0)
        for schedule in self._schedules:
            schedule.total_steps = horizon

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        steps = trainer.global_step - getattr(self, "_first_step", trainer.global_step)
        if self._schedules and time_left(trainer) is not None and steps > 0 and steps % self.every == 0:
            self._estimate(trainer, steps / max(time.monotonic() - self._started, 1e-9))


class RunProgressBar(RichProgressBar):
    """Lightning's rich progress bar with the whole run's time left (``run_eta``) beside the
    epoch's, and the epoch's number alone where no epoch limit is set (Lightning writes
    ``Epoch 2/-2`` for ``max_epochs=-1``, a budget in steps)."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        if self.trainer.max_epochs is not None and self.trainer.max_epochs > 0:
            description += f"/{self.trainer.max_epochs - 1}"
        return f"{description:{len(self.validation_description)}}"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._started, self._first_step = time.monotonic(), trainer.global_step

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        if trainer.training and hasattr(self, "_started"):
            eta = run_eta(trainer, time.monotonic() - self._started, trainer.global_step - self._first_step)
            if eta is not None:
                items["run left"] = hms(eta)
        return items


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint to a temporary file in the target folder, flushes it to disk and renames
    it over the target, so a crash while saving leaves the previous file intact. (Non-finite weights
    never reach it: ``TranslationModule.on_save_checkpoint`` refuses them first, on every DDP rank.)"""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if "://" in str(path):  # remote storage: Lightning's fsspec writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_save(checkpoint, path)

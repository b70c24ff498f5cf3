"""Callbacks of our own; the rest of ``conf/callbacks/`` are Lightning's."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as L
import torch
from lightning_fabric.plugins import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities.exceptions import SIGTERMException

from nmt.checkpoint import nonfinite

log = logging.getLogger(__name__)


class PreemptionCheckpoint(Callback):
    """Save ``<dirpath>/<filename>.ckpt`` when the job is told to end, then let training stop.

    SIGTERM: Lightning's handler sets ``trainer.received_sigterm`` and its loops raise
    ``SIGTERMException`` at the next safe point (after the running training batch, and after the
    validation that is due then; or after the running validation batch); this callback saves in
    ``on_exception``, so the checkpoint holds the state after that batch, data position included.
    ``signals`` (default SIGUSR1, SIGUSR2: SLURM's ``--signal``, submitit) take the same path,
    unless another handler already owns them (Lightning's SLURM auto-requeue handles SIGUSR1).
    ``signal`` holds the signal that stopped training, for ``train()`` to report and exit with.
    """

    def __init__(self, dirpath: str, filename: str = "last", signals: Sequence[str] = ("SIGUSR1", "SIGUSR2")) -> None:
        self.path = Path(dirpath) / f"{filename}.ckpt"
        self.signals = [getattr(signal, name) for name in signals]
        self.signal: int | None = None
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
        self.signal = self.signal or signal.SIGTERM
        trainer.save_checkpoint(self.path)
        log.warning("stopped by %s at step %d (epoch %d); saved %s; resume with ckpt_path=%s",
                    signal.Signals(self.signal).name, trainer.global_step, trainer.current_epoch, self.path, self.path)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_handlers()
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":
            self._save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A signal during the last batch ends the fit normally: still save, and report it."""
        self._restore_handlers()
        if trainer.received_sigterm:
            self._save(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handlers()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint to a temporary file in the target folder, flushes it to disk and renames
    it over the target, so a crash while saving leaves the previous file intact. Refuses (ValueError)
    to write a checkpoint whose weights are not finite, so a diverged model never replaces a good one."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        bad = nonfinite(checkpoint.get("state_dict", {}).items())
        if bad:
            raise ValueError(
                f"refusing to write {path}: non-finite weights in {', '.join(bad[:5])}"
                f"{' ...' if len(bad) > 5 else ''}; the checkpoints already written are kept"
            )
        if "://" in str(path):  # remote storage: Lightning's fsspec writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

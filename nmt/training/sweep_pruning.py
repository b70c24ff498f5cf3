"""Optuna pruning for a Hydra sweep: a trial whose validation BLEU falls behind the earlier
trials' at the same step stops there, so a sweep spends its steps on the promising recipes.

Hydra's Optuna sweeper hands its trials to the launcher as overrides and reads back one number
per run; it gives the run no handle on its trial. The sweep folder is the shared record instead:
every run of the sweep writes its validation curve to ``<run dir>/pruning.json``, and at each
validation the callback asks an Optuna pruner (``optuna.pruners.MedianPruner`` and the others,
unchanged) to judge its own curve against the finished runs' curves in the sibling folders. That
works with any launcher whose runs share the sweep folder (the basic one, submitit on one machine
or on SLURM). A pruned run stops training at once; it still returns its best validation BLEU, so
the sweeper records it as a finished, poor trial (its ``pruning.json`` says ``pruned`` and where).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as L
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.trainer.states import TrainerFn

log = logging.getLogger(__name__)

CURVE_FILE = "pruning.json"
STATES = ("running", "complete", "pruned")


def read_curve(path: Path) -> dict[str, Any] | None:
    """A sibling run's ``pruning.json`` ({state, curve: {step: value}}), or None when it is not
    one (being written, from another program, damaged): a sweep never stops on a neighbour's file."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        state, curve = record["state"], {int(step): float(value) for step, value in record["curve"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return {"state": state, "curve": curve} if state in STATES else None


def sweep_records(sweep_dir: Path, own: Path) -> list[dict[str, Any]]:
    """The finished runs of the sweep (complete or pruned) beside ``own`` run folder."""
    records = []
    for path in sorted(sweep_dir.glob(f"*/{CURVE_FILE}")):
        if path.parent.resolve() == own.resolve():
            continue
        record = read_curve(path)
        if record is not None and record["state"] != "running" and record["curve"]:
            records.append(record)
    return records


def should_prune(pruner: Any, records: list[dict[str, Any]], curve: dict[int, float]) -> bool:
    """Optuna's ``pruner`` on ``curve`` (step -> validation BLEU so far) against the finished
    ``records``, as a maximising study holding them."""
    import optuna
    from optuna.trial import TrialState, create_trial

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(direction="maximize")
        for record in records:
            complete = record["state"] == "complete"
            study.add_trial(create_trial(
                state=TrialState.COMPLETE if complete else TrialState.PRUNED,
                value=max(record["curve"].values()) if complete else None,
                intermediate_values=record["curve"], params={}, distributions={}))
        trial = create_trial(state=TrialState.RUNNING, intermediate_values=curve, params={}, distributions={})
    return bool(pruner.prune(study, trial))


class OptunaPruning(Callback):
    """Stops training when Optuna's ``pruner`` judges the run's ``monitor`` curve, reported at
    every validation, worse than the sweep's finished runs (see the module's text).

    ``sweep_dir``: the folder holding the sweep's run folders (``hydra.sweep.dir``); ``run_dir``:
    this run's (``hydra.runtime.output_dir``). Outside a sweep (``sweep_dir`` null) it does
    nothing. Only rank 0 judges; its decision reaches every rank.
    """

    def __init__(self, pruner: Any, sweep_dir: str | None, run_dir: str, monitor: str = "val/bleu") -> None:
        super().__init__()
        self.pruner, self.monitor = pruner, monitor
        self.sweep_dir = Path(sweep_dir) if sweep_dir else None
        self.run_dir = Path(run_dir)
        self.curve: dict[int, float] = {}
        self.pruned_at: int | None = None

    def _write(self, state: str) -> None:
        path = self.run_dir / CURVE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"state": state, "curve": {str(k): v for k, v in sorted(self.curve.items())}, "monitor": self.monitor,
                  "pruned_at": self.pruned_at}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)  # a sibling never reads half a file

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.sweep_dir is None or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        value = trainer.callback_metrics.get(self.monitor)
        prune = False
        if trainer.is_global_zero and value is not None:
            self.curve[trainer.global_step] = float(value)
            prune = should_prune(self.pruner, sweep_records(self.sweep_dir, self.run_dir), self.curve)
            if prune:
                self.pruned_at = trainer.global_step
                log.info("pruned at step %d: %s %.2f is behind the sweep's finished runs (%s)", trainer.global_step,
                         self.monitor, float(value), type(self.pruner).__name__)
            self._write("pruned" if prune else "running")
        if trainer.strategy.broadcast(prune, src=0):
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.sweep_dir is not None and trainer.is_global_zero and self.pruned_at is None:
            self._write("complete")

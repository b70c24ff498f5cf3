"""Optuna pruning of a sweep's runs through the sweep folder (nmt.training.sweep_pruning)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from nmt.training.sweep_pruning import CURVE_FILE, read_curve, should_prune, sweep_records  # noqa: E402
from nmt.train import train  # noqa: E402


def sibling(sweep: Path, name: str, state: str, curve: dict[int, float]) -> Path:
    run = sweep / name
    run.mkdir(parents=True)
    (run / CURVE_FILE).write_text(json.dumps({"state": state, "curve": {str(k): v for k, v in curve.items()}}))
    return run


def median(startup: int = 2) -> optuna.pruners.MedianPruner:
    return optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=0)


def test_a_curve_below_the_finished_runs_median_is_pruned():
    records = [{"state": "complete", "curve": {250: 40.0, 500: 70.0}},
               {"state": "complete", "curve": {250: 50.0, 500: 60.0}}]
    assert should_prune(median(), records, {250: 44.9})  # median at step 250: 45
    assert not should_prune(median(), records, {250: 45.0})
    assert not should_prune(median(), records, {250: 30.0, 500: 66.0})  # judged at its last step: median 65
    assert should_prune(median(), records, {250: 60.0, 500: 64.0})
    # fewer finished runs than the pruner's startup count: nothing is pruned
    assert not should_prune(median(startup=3), records, {250: 0.0})
    # a pruned run's curve counts where it reached; the median is over complete runs only
    pruned = [{"state": "pruned", "curve": {250: 0.0}}]
    assert not should_prune(median(startup=2), records[:1] + pruned, {250: 0.0})


def test_sweep_records_read_finished_siblings_only(tmp_path):
    own = sibling(tmp_path, "0", "running", {250: 1.0})
    sibling(tmp_path, "1", "complete", {250: 10.0, 500: 20.0})
    sibling(tmp_path, "2", "pruned", {250: 5.0})
    sibling(tmp_path, "3", "running", {250: 50.0})
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / CURVE_FILE).write_text('{"state": "complete", "curve": {"250": ')  # half written
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / CURVE_FILE).write_text('{"state": "won", "curve": {"250": 99}}')
    (tmp_path / "6").mkdir()
    (tmp_path / "6" / CURVE_FILE).write_text('[1, 2]')
    records = sweep_records(tmp_path, own)
    assert records == [{"state": "complete", "curve": {250: 10.0, 500: 20.0}}, {"state": "pruned", "curve": {250: 5.0}}]
    assert read_curve(tmp_path / "missing" / CURVE_FILE) is None


PRUNING = ["+callbacks.optuna_pruning._target_=nmt.training.sweep_pruning.OptunaPruning",
           "+callbacks.optuna_pruning.pruner._target_=optuna.pruners.MedianPruner",
           "+callbacks.optuna_pruning.pruner.n_startup_trials=1", "+callbacks.optuna_pruning.pruner.n_warmup_steps=0",
           "trainer.max_epochs=-1", "trainer.max_steps=6", "trainer.val_check_interval=2",
           "trainer.check_val_every_n_epoch=null", "test=false"]


@pytest.mark.parametrize("others, ended_by, steps", [(100.0, "pruned", 2), (0.0, "max_steps", 6)])
def test_a_run_behind_the_sweep_stops_at_that_validation(cfg_train, tmp_path, others, ended_by, steps):
    sweep = tmp_path / "sweep"
    sibling(sweep, "0", "complete", {2: others, 4: others, 6: others})
    run_dir = sweep / "1"
    cfg = cfg_train([*PRUNING, f"+callbacks.optuna_pruning.sweep_dir={sweep}",
                     f"+callbacks.optuna_pruning.run_dir={run_dir}"])
    train(cfg)
    summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    assert (summary["ended_by"], summary["steps"]) == (ended_by, steps)
    record = json.loads((run_dir / CURVE_FILE).read_text())
    assert record["state"] == ("pruned" if ended_by == "pruned" else "complete")
    assert [int(step) for step in record["curve"]] == list(range(2, steps + 1, 2))
    assert record["pruned_at"] == (2 if ended_by == "pruned" else None)


def test_outside_a_sweep_the_callback_does_nothing(cfg_train, tmp_path):
    cfg = cfg_train([*PRUNING, "+callbacks.optuna_pruning.sweep_dir=null", f"+callbacks.optuna_pruning.run_dir={tmp_path / 'r'}"])
    train(cfg)
    assert json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())["ended_by"] == "max_steps"
    assert not (tmp_path / "r").exists()

"""Lightning's debugging flags and the debug= configs: validation and test score exactly the
sentences they decoded, and the BLEU-by-length report counts those."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from types import SimpleNamespace

import pytest
from pytorch_lightning.callbacks import Timer

from nmt.training.callbacks import hms, run_eta
from nmt.train import train
from tests.conftest import ROOT, compose_train

SPLITS = {split: len((ROOT / f"tests/data/tiny/{split}.src").read_text().splitlines()) for split in ("valid", "test")}


def report(cfg) -> dict:
    run = Path(cfg.paths.output_dir)
    hyps = (run / "test_hyps.txt").read_text(encoding="utf-8").splitlines()
    data = json.loads((run / "bleu_by_length.json").read_text())
    assert data["count"] == len(hyps)
    return data


@pytest.mark.parametrize("overrides, val_partial, test_partial", [
    (["debug=fdr"], True, True),
    (["trainer.limit_val_batches=1", "trainer.limit_test_batches=1"], True, True),
    (["debug=limit", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=0.5"],
     True, True),
    (["debug=overfit", "trainer.max_epochs=2", "trainer.overfit_batches=1"], True, False),  # test: the whole split
    (["trainer.val_check_interval=0.5", "trainer.max_epochs=1"], False, False),
    (["debug=profiler"], False, False),
], ids=["fdr", "limit_val_batches", "limit", "overfit", "fractional_val_check_interval", "profiler"])
def test_debugging_flags_score_the_sentences_they_decode(cfg_train, caplog, overrides, val_partial, test_partial):
    cfg = cfg_train(overrides, model="lstm")
    with caplog.at_level(logging.INFO):
        metrics = train(cfg)
    assert "val/bleu" in metrics and "test/bleu" in metrics
    count = report(cfg)["count"]
    logged = [r.getMessage() for r in caplog.records if "sentences decoded" in r.getMessage()]
    assert any(m.startswith("val: scoring the ") for m in logged) == val_partial, logged
    if test_partial:  # fewer sentences than the split, and the log says how many
        assert count < SPLITS["test"]
        assert any(f"test: scoring the {count} of {SPLITS['test']} test sentences" in m for m in logged), logged
    else:
        assert count == SPLITS["test"] and not any(m.startswith("test:") for m in logged)
    # The run ends with a summary: scores, the by-length table, the files, the translate command.
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run finished:")]
    assert f"({count} sentences; step " in summary and "| all |" in summary
    assert f"translate: nmt-translate ckpt={Path(cfg.paths.output_dir)}/checkpoints/" in summary


def test_the_progress_bar_shows_the_time_the_run_has_left():
    timer = Timer(duration="00:00:10:00")
    trainer = SimpleNamespace(callbacks=[], max_steps=1000, global_step=100, max_epochs=-1, num_training_batches=50,
                              accumulate_grad_batches=1)
    assert run_eta(trainer, seconds=30.0, steps=100) == pytest.approx(270.0)  # 900 steps at 0.3 s
    trainer.max_steps, trainer.max_epochs = -1, 4  # 4 epochs of 50 batches: 100 steps left
    assert run_eta(trainer, seconds=30.0, steps=100) == pytest.approx(30.0)
    trainer.callbacks = [timer]
    timer.time_remaining = lambda stage="train": 12.0  # the budget ends first
    assert run_eta(trainer, seconds=30.0, steps=100) == 12.0
    timer.time_remaining = lambda stage="train": -0.6  # spent: the bar shows 0, not a wrapped 23:59:59
    assert run_eta(trainer, seconds=30.0, steps=100) == 0.0
    trainer.callbacks, trainer.max_epochs = [], -1
    assert run_eta(trainer, seconds=30.0, steps=100) is None
    assert [hms(s) for s in (0.0, 59.6, 3600 * 25 + 61)] == ["0:00:00", "0:01:00", "25:01:01"]


def test_debug_configs_compose(tmp_path):
    for name in ("default", "fdr", "limit", "overfit", "profiler"):
        cfg = compose_train(tmp_path, [f"debug={name}"], model="lstm")
        assert cfg.task_name == "debug" and cfg.trainer.accelerator == "cpu" and cfg.trainer.max_time is None


def test_the_progress_bar_can_be_turned_off_with_lightnings_flag(cfg_train):
    """``trainer.enable_progress_bar=false`` drops the configured bar, which Lightning would refuse."""
    cfg = cfg_train(["trainer.enable_progress_bar=false", "test=false", "trainer.max_steps=1",
                     "+callbacks.bar={_target_: nmt.training.callbacks.RunProgressBar}"], model="lstm")
    assert "train/loss" in train(cfg)

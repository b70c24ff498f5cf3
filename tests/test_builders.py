"""The builders (nmt/training/builders.py): the Trainer gets what the config names and nothing else, config
rules fail naming their keys, and testing a checkpoint leaves the run's counters alone."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from lightning_fabric.plugins import TorchCheckpointIO
from omegaconf import open_dict
from pytorch_lightning.callbacks import Callback, ProgressBar

import nmt.training.builders
from nmt.training.builders import build_callbacks, build_loggers, build_trainer, trainer_processes
from nmt.training.callbacks import AtomicCheckpointIO, ScheduleHorizon
from nmt.checkpoints.files import read_checkpoint
from nmt.train import train
from tests.conftest import CONF_DIR, ROOT


def trainer_of(cfg):
    return build_trainer(cfg, build_callbacks(cfg), build_loggers(cfg))


def test_two_cpu_devices_are_two_ddp_processes_as_the_trainer_counts_them(cfg_train):
    """trainer.accelerator=cpu trainer.devices=2: two processes under DDP (gloo), the number the
    Trainer built from the same config holds as its world size; num_nodes multiplies it."""
    from pytorch_lightning.strategies import DDPStrategy

    for overrides, processes in ((["trainer.devices=2"], 2), (["trainer.devices=auto"], 1),
                                 (["trainer.devices=2", "trainer.num_nodes=2"], 4), (["trainer=ddp", "trainer.accelerator=cpu"], 2)):
        cfg = cfg_train(["trainer.accelerator=cpu", *overrides])
        trainer = trainer_of(cfg)
        assert trainer_processes(cfg.trainer) == trainer.world_size == processes, overrides
        assert isinstance(trainer.strategy, DDPStrategy) == (processes > 1)


@pytest.mark.parametrize("devices, num_nodes, processes", [("auto", 1, 8), (-1, 1, 8), ("-1", 2, 16), ([0, 3], 1, 2),
                                                           ("0,1,2", 1, 3), ("2", 2, 4), (1, 1, 1), ([5], 3, 3)])
def test_every_form_of_trainer_devices_counts_the_processes(cfg_train, monkeypatch, devices, num_nodes, processes):
    """On a machine that shows 8 GPUs (Lightning's device count replaced), every form of
    ``trainer.devices`` Lightning accepts gives the processes it runs: all of them for auto and -1,
    as many as a list or a string names."""
    import lightning_fabric.accelerators.cuda
    import pytorch_lightning.accelerators.cuda

    for module in (lightning_fabric.accelerators.cuda, pytorch_lightning.accelerators.cuda):
        monkeypatch.setattr(module, "num_cuda_devices", lambda: 8)
    cfg = cfg_train(["trainer.accelerator=auto"])
    with open_dict(cfg):
        cfg.trainer.devices, cfg.trainer.num_nodes = devices, num_nodes
    assert trainer_processes(cfg.trainer) == processes


def test_the_trainer_gets_the_configs_plugins_and_callbacks(cfg_train):
    trainer = trainer_of(cfg_train())
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO  # trainer/default.yaml's plugins
    assert sum(isinstance(cb, ScheduleHorizon) for cb in trainer.callbacks) == 1  # callbacks/default.yaml's
    bare = trainer_of(cfg_train(["trainer.plugins=[]", "~callbacks.schedule_horizon", "scheduler.total_steps=100"]))
    assert type(bare.strategy.checkpoint_io) is TorchCheckpointIO  # nothing added to what the config says
    assert not any(isinstance(cb, ScheduleHorizon) for cb in bare.callbacks)


def test_a_budget_decay_without_callbacks_schedule_horizon_does_not_start(cfg_train):
    cfg = cfg_train(["~callbacks.schedule_horizon", "scheduler=cosine", "trainer.max_steps=-1", "trainer.max_epochs=2"])
    with pytest.raises(ValueError) as err:
        build_callbacks(cfg)
    assert str(err.value) == (
        "scheduler.total_steps=-1: the learning-rate decay ends with the run's budget, which "
        "callbacks.schedule_horizon (nmt.training.callbacks.ScheduleHorizon) finds, and the callbacks have none: add it "
        "(callbacks/default.yaml has it) or set scheduler.total_steps (or trainer.max_steps)")
    with pytest.raises(ValueError, match=r"^scheduler.total_steps=-1: the learning-rate decay ends"):
        train(cfg)  # before any training
    for ok in (["scheduler.total_steps=50"], ["scheduler=inverse_sqrt"], ["scheduler=plateau"]):
        build_callbacks(cfg_train(["~callbacks.schedule_horizon", "trainer.max_steps=-1", *ok]))


def test_a_fractional_val_check_interval_needs_an_epoch_cadence(cfg_train):
    cfg = cfg_train(["trainer.val_check_interval=0.5", "trainer.check_val_every_n_epoch=null"])
    with pytest.raises(ValueError) as err:
        trainer_of(cfg)
    assert str(err.value) == (
        "trainer.val_check_interval=0.5 (a float: a fraction of an epoch) needs trainer.check_val_every_n_epoch "
        "(1: every epoch); with check_val_every_n_epoch=null it counts training batches across epochs and must "
        "be a whole number")
    assert trainer_of(cfg_train(["trainer.val_check_interval=0.5"])).check_val_every_n_epoch == 1  # TINY sets 1


def test_progress_bars_are_left_out_when_the_trainer_has_none(cfg_train, caplog):
    cfg = cfg_train(["trainer.enable_progress_bar=false", "+callbacks.bar={_target_: nmt.training.callbacks.RunProgressBar}"])
    with caplog.at_level(logging.INFO, logger="nmt.training.builders"):
        trainer = trainer_of(cfg)
    assert not any(isinstance(cb, ProgressBar) for cb in trainer.callbacks)
    assert "trainer.enable_progress_bar=false: leaving out the configured RunProgressBar" in caplog.text


def compose_defaults(tmp_path: Path, overrides: list[str]):
    """The train config as a user's command line composes it (no test overrides), Hydra's runtime set."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path / "run")
        cfg.hydra.runtime.cwd = str(ROOT)
        cfg.hydra.job.num = 0
        cfg.paths.cache_dir = str(tmp_path / "cache")
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.trainer.precision = "32-true"  # the build is checked, not the precision auto picks
    return cfg


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
@pytest.mark.parametrize("bar", [True, False], ids=["progress_bar", "no_progress_bar"])
def test_every_experiment_builds_its_callbacks_and_trainer(tmp_path, monkeypatch, experiment, bar):
    monkeypatch.setattr("nmt.training.progress_lines.output_is_terminal", lambda: True)  # where a bar is shown
    cfg = compose_defaults(tmp_path, [f"experiment={experiment}", "trainer.accelerator=cpu", "logger=csv",
                                      f"trainer.enable_progress_bar={str(bar).lower()}"])
    trainer = trainer_of(cfg)
    assert any(isinstance(cb, ProgressBar) for cb in trainer.callbacks) == bar
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO
    GlobalHydra.instance().clear()


class Counters(Callback):
    """The module's counters where training and testing end."""

    def __init__(self) -> None:
        self.at: dict[str, dict[str, float]] = {}

    def _record(self, stage: str, module) -> None:
        self.at[stage] = {name: getattr(module, name) for name in module.COUNTERS} | {"best_bleu": module.best_bleu}

    def on_train_end(self, trainer, module) -> None:
        self._record("fit", module)

    def on_test_end(self, trainer, module) -> None:
        self._record("test", module)


def with_counters(monkeypatch, cfg) -> Counters:
    spy, original = Counters(), nmt.training.builders.instantiate_group
    monkeypatch.setattr(nmt.training.builders, "instantiate_group",
                        lambda group: [*original(group), spy] if group is cfg.get("callbacks") else original(group))
    return spy


def test_testing_a_checkpoint_keeps_the_runs_counters(cfg_train, monkeypatch, caplog):
    """The best checkpoint by the highest val/loss is the first epoch's: the test decodes those
    weights, and the counters after it are the whole run's, not that checkpoint's."""
    cfg = cfg_train(["trainer.max_epochs=3", "callbacks.model_checkpoint.monitor=val/loss",
                     "callbacks.model_checkpoint.mode=max", "callbacks.model_checkpoint.save_top_k=1"], model="lstm")
    spy = with_counters(monkeypatch, cfg)
    train(cfg)
    best = read_checkpoint(next(Path(cfg.paths.output_dir, "checkpoints").glob("epoch000-*.ckpt")))
    last = read_checkpoint(Path(cfg.paths.output_dir, "checkpoints", "last.ckpt"))
    assert best["counters"]["train_tokens"] < last["counters"]["train_tokens"]
    assert spy.at["test"] == spy.at["fit"] and spy.at["fit"]["train_tokens"] == last["counters"]["train_tokens"]

    # train=false: a run that only tests a checkpoint trained nothing, also while it tests.
    ckpt = Path(cfg.paths.output_dir, "checkpoints", "last.ckpt")
    only = cfg_train(["train=false", f"ckpt_path={ckpt}"], model="lstm")
    spy = with_counters(monkeypatch, only)
    with caplog.at_level(logging.INFO, logger="nmt.training.lit_module"):
        train(only)
    assert spy.at["test"]["train_tokens"] == 0 and spy.at["test"]["best_bleu"] == -math.inf
    tested = [r.getMessage() for r in caplog.records if r.getMessage().startswith("test at step")]
    assert len(tested) == 1 and tested[0].startswith(f"test at step {last['global_step']}:")  # the file's step


def test_a_fit_resumed_from_a_checkpoint_takes_its_counters(cfg_train):
    """Outside a Trainer, as in a resumed fit, the checkpoint's counters and best score are the module's."""
    cfg = cfg_train()
    module = nmt.training.builders.build_module(cfg, nmt.training.builders.build_model(cfg, 40, 40))
    module.on_load_checkpoint({"counters": {"train_tokens": 100, "train_tgt_tokens": 40, "train_seconds": 2.0},
                               "best_bleu": 12.5, "global_step": 7})
    assert (module.train_tokens, module.best_bleu, module.loaded_step) == (100, 12.5, 7)

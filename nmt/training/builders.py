"""The objects a run config describes, built with ``hydra.utils.instantiate``: the data module, the
model, the ``TranslationModule``, callbacks, loggers and the Trainer. ``nmt.train`` calls them in
order; the scripts build their models the same way.

Nothing is added that the config does not name (the default checkpoint writer, the schedule
horizon and the progress bar are nodes in ``nmt/conf``). Rules that would otherwise fail inside
Lightning with its own names, or train with a decay that never ends, fail here naming the keys;
one is applied and logged: ``trainer.enable_progress_bar=false`` leaves out configured progress bars,
and so does output that is not a terminal where ``callbacks.progress_lines`` logs progress instead.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import pytorch_lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from pytorch_lightning.callbacks import Callback, ModelCheckpoint, ProgressBar

from nmt.training.callbacks import ScheduleHorizon
from nmt.training.compiling import CompilePlan, gpu_compiler_available, resolve_compile
from nmt.training.progress_lines import ProgressLines
from nmt.machine import training_device
from nmt.models.base import seq2seq_config
from nmt.checkpoints.files import saved_vocabularies
from nmt.decoding.search import search_of
from nmt.decoding.settings import SearchSettings

log = logging.getLogger(__name__)

# Loggers whose packages are extras: logger class -> (importable modules, extra).
LOGGER_EXTRAS = {"WandbLogger": (("wandb",), "wandb"), "TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard")}


def build_datamodule(data_cfg: DictConfig | dict[str, Any]) -> L.LightningDataModule:
    """Instantiate a data config; ``data.vocab_from`` is read with ``nmt.checkpoints.files.saved_vocabularies``."""
    try:
        return instantiate(OmegaConf.create(data_cfg) if isinstance(data_cfg, dict) else data_cfg,
                           vocab_loader=saved_vocabularies)
    except InstantiationException as e:  # a bad data key (ValueError, DataError): the data module's own message
        if isinstance(e.__cause__, ValueError):  # DataError is one
            raise e.__cause__ from None
        raise


def build_model(cfg: DictConfig, src_vocab_size: int, tgt_vocab_size: int) -> torch.nn.Module:
    """Instantiate ``cfg.model`` with the vocabulary sizes filled in (cfg is updated)."""
    with open_dict(cfg):
        cfg.model.src_vocab_size = src_vocab_size
        cfg.model.tgt_vocab_size = tgt_vocab_size
    model = instantiate_model(cfg.model).set_kernels(cfg.get("kernels", "auto"))
    plan = compile_plan(cfg)
    if plan is not None:
        model.compile_features(plan.dynamic, plan.mode, plan.backend)
    return model


def instantiate_model(model_cfg: DictConfig | dict[str, Any]) -> torch.nn.Module:
    """``hydra.utils.instantiate`` of a model config, its shared sizes left out once they have
    reached the encoder and decoder (``nmt.models.base.seq2seq_config``)."""
    resolved = OmegaConf.to_container(model_cfg, resolve=True) if OmegaConf.is_config(model_cfg) else dict(model_cfg)
    key = (model_cfg._key() if OmegaConf.is_config(model_cfg) else None) or "model"
    return instantiate(OmegaConf.create({key: seq2seq_config(resolved)})[key])  # errors name "model.<key>"


def compile_plan(cfg: DictConfig) -> CompilePlan | None:
    """How ``cfg.compile`` compiles the training pass on the run's device and batch shapes."""
    device = training_device(cfg)
    return resolve_compile(cfg.get("compile", "false"), device, cfg.data.get("shapes", "exact"),
                           gpu_compiler_available() if device == "cuda" else True)


def build_module(cfg: DictConfig, model: torch.nn.Module) -> L.LightningModule:
    return instantiate(
        cfg.module,
        model=model,
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
        val_decoding=search_of(SearchSettings.from_config(cfg.val_decoding)),
        test_decoding=search_of(SearchSettings.from_config(cfg.test_decoding)),
    )


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """The objects of a config group's ``_target_`` nodes (``callbacks``, ``logger``); null nodes are skipped."""
    if not group:
        return []
    return [instantiate(node) for node in group.values() if isinstance(node, DictConfig) and "_target_" in node]


def build_callbacks(cfg: DictConfig) -> list[Callback]:
    """``cfg.callbacks``, less its progress bars when ``trainer.enable_progress_bar=false`` (Lightning
    refuses both at once) or when ``callbacks.progress_lines`` logs progress (the output is not a
    terminal: a bar would draw only its last frame); a decay that ends with the run's budget needs
    ``callbacks.schedule_horizon``."""
    callbacks = instantiate_group(cfg.get("callbacks"))
    bars = [type(cb).__name__ for cb in callbacks if isinstance(cb, ProgressBar)]
    if bars and not cfg.trainer.get("enable_progress_bar", True):
        log.info("trainer.enable_progress_bar=false: leaving out the configured %s", ", ".join(bars))
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    elif bars and any(isinstance(cb, ProgressLines) and cb.active for cb in callbacks):
        every = next(cb.every for cb in callbacks if isinstance(cb, ProgressLines))
        log.info("the output is not a terminal: progress as a log line every %d steps (callbacks.progress_lines) "
                 "instead of the progress bar", every)
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    if cfg.get("scheduler") and not any(isinstance(cb, ScheduleHorizon) for cb in callbacks):
        probe = instantiate(cfg.scheduler)(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0))
        if getattr(probe, "from_budget", False):
            raise ValueError(f"scheduler.total_steps={cfg.scheduler.get('total_steps')}: the learning-rate decay ends "
                             "with the run's budget, which callbacks.schedule_horizon (nmt.training.callbacks.ScheduleHorizon) "
                             "finds, and the callbacks have none: add it (callbacks/default.yaml has it) or set "
                             "scheduler.total_steps (or trainer.max_steps)")
    return callbacks


def check_logger_packages(group: DictConfig | None) -> None:
    """An ImportError naming the extra to install for a chosen logger whose package is missing."""
    for name, node in (group or {}).items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        modules, extra = LOGGER_EXTRAS.get(str(node._target_).rsplit(".", 1)[-1], ((), ""))
        if modules and not any(importlib.util.find_spec(m) for m in modules):
            raise ImportError(f"logger {name} ({node._target_}) needs the {modules[0]} package: "
                              f"pip install 'nmt[{extra}]' (or choose logger=csv)")


def build_loggers(cfg: DictConfig) -> list[Any]:
    check_logger_packages(cfg.get("logger"))
    return instantiate_group(cfg.get("logger"))


def build_trainer(cfg: DictConfig, callbacks: list[Callback], loggers: list[Any]) -> L.Trainer:
    """``cfg.trainer`` (its ``plugins`` included) with these callbacks and loggers. Lightning's own
    checkpointing is on only where the callbacks hold a top-k ``ModelCheckpoint`` (else Lightning
    would add one under the logger's folder; ``last.ckpt`` is ``LastCheckpoint``'s either way)."""
    interval = cfg.trainer.get("val_check_interval")
    if isinstance(interval, float) and cfg.trainer.get("check_val_every_n_epoch") is None:
        raise ValueError(f"trainer.val_check_interval={interval} (a float: a fraction of an epoch) needs "
                         "trainer.check_val_every_n_epoch (1: every epoch); with check_val_every_n_epoch=null "
                         "it counts training batches across epochs and must be a whole number")
    checkpointing = any(isinstance(cb, ModelCheckpoint) for cb in callbacks)
    extra = {}
    if not any(isinstance(cb, ProgressBar) for cb in callbacks) and \
            any(isinstance(cb, ProgressLines) and cb.active for cb in callbacks):
        extra["enable_progress_bar"] = False  # the lines report progress: Lightning would add its own bar
    return instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, enable_checkpointing=checkpointing,
                       **extra)


def trainer_processes(trainer_cfg: DictConfig) -> int:
    """How many processes ``cfg.trainer`` trains with, as the Trainer will resolve them: Lightning's
    own accelerator connector reads ``accelerator``, ``strategy``, ``devices`` (a count, ``auto`` or
    ``-1``: every device the accelerator sees, a list of indices, or a string such as ``"0,1"``) and
    ``num_nodes``; the strategy's world size is the answer (``num_nodes`` x the devices of a node)."""
    from pytorch_lightning.trainer.connectors.accelerator_connector import _AcceleratorConnector

    def plain(value: Any) -> Any:
        if isinstance(value, DictConfig) and "_target_" in value:
            return instantiate(value)
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value

    connector = _AcceleratorConnector(devices=plain(trainer_cfg.get("devices", "auto")),
                                      num_nodes=int(trainer_cfg.get("num_nodes", 1)),
                                      accelerator=plain(trainer_cfg.get("accelerator", "auto")),
                                      strategy=plain(trainer_cfg.get("strategy", "auto")))
    return int(getattr(connector.strategy, "world_size", 1))  # Trainer.world_size reads it so

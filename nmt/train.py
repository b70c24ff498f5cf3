"""Train a model from the Hydra config in ``nmt/conf/train.yaml``: ``python train.py model=transformer``.

``train(cfg)`` builds the data module, the model (its vocabulary sizes read from the trained
SentencePiece models), the ``TranslationModule``, callbacks, loggers and the Trainer; fits; then
tests the best checkpoint. It returns the final metrics, which a sweeper optimises.

``checkpoints/last.ckpt`` holds the final weights whatever ended training, before the test runs;
``summary.json`` and the test report name the checkpoint file and step they scored.
``ckpt_path=<run>/checkpoints/last.ckpt`` (or ``ckpt_path=latest``: the newest ``last.ckpt`` of
``<paths.log_dir>/<task_name>/runs/*``) resumes: weights, optimizer, scheduler, step, epoch, data
position, RNG state and the module's counters; a checkpoint that does not fit the configured model
or vocabulary is refused before training starts. Checkpoints are written atomically and read with
``weights_only=True`` (``allow_pickle=true`` reads trusted checkpoints of older versions). A run
stopped by SIGTERM (or SLURM's SIGUSR1/SIGUSR2) saves ``last.ckpt`` and exits with status 128 + signal.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import platform
import signal
import time
from pathlib import Path
from typing import Any

import hydra
import pytorch_lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from pytorch_lightning.callbacks import ModelCheckpoint, ProgressBar
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities.exceptions import SIGTERMException

from nmt import CONF_DIR, auto_precision, register_resolvers
from nmt.callbacks import AtomicCheckpointIO, LastCheckpoint, ScheduleHorizon, budget_timer, ended_by
from nmt.checkpoint import check_resume, saved_vocabularies, tokenizer_protos
from nmt.length_report import markdown_table
from nmt import kernels
from nmt.kernels.malloc import bound_onednn_cache, keep_freed_memory, release_freed_memory

log = logging.getLogger(__name__)


def training_device(cfg: DictConfig) -> str:
    """``cpu`` or ``cuda``: where ``cfg.trainer`` trains."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator in ("gpu", "cuda") else accelerator


def resolve_precision(cfg: DictConfig) -> None:
    """``trainer.precision=auto`` becomes what ``nmt.auto_precision`` picks for the training device; logged."""
    if str(cfg.trainer.get("precision")) != "auto":
        return
    precision, why = auto_precision(training_device(cfg))
    with open_dict(cfg):
        cfg.trainer.precision = precision
    log.info("trainer.precision=auto: %s (%s; trainer.precision=32-true trains in fp32)", precision, why)


def build_datamodule(data_cfg: DictConfig | dict[str, Any]) -> L.LightningDataModule:
    """Instantiate a data config; ``data.vocab_from`` is read with ``nmt.checkpoint.saved_vocabularies``."""
    return instantiate(OmegaConf.create(data_cfg) if isinstance(data_cfg, dict) else data_cfg,
                       vocab_loader=saved_vocabularies)


def build_model(cfg: DictConfig, src_vocab_size: int, tgt_vocab_size: int) -> torch.nn.Module:
    """Instantiate ``cfg.model`` with the vocabulary sizes filled in (cfg is updated)."""
    with open_dict(cfg):
        cfg.model.src_vocab_size = src_vocab_size
        cfg.model.tgt_vocab_size = tgt_vocab_size
    model = instantiate(cfg.model).set_kernels(cfg.get("kernels", "auto"))
    if cfg.get("compile"):
        model.compile_features()
    return model


def build_module(cfg: DictConfig, model: torch.nn.Module):
    return instantiate(
        cfg.module,
        model=model,
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
        val_decoding=instantiate(cfg.val_decoding),
        test_decoding=instantiate(cfg.test_decoding),
    )


def _instantiate_group(group: DictConfig | None) -> list[Any]:
    if not group:
        return []
    return [instantiate(node) for node in group.values() if isinstance(node, DictConfig) and "_target_" in node]


# Loggers whose packages are extras: logger class -> (importable modules, extra).
LOGGER_EXTRAS = {"WandbLogger": (("wandb",), "wandb"), "TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard")}


def check_logger_packages(group: DictConfig | None) -> None:
    """An ImportError naming the extra to install for a chosen logger whose package is missing."""
    for name, node in (group or {}).items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        modules, extra = LOGGER_EXTRAS.get(str(node._target_).rsplit(".", 1)[-1], ((), ""))
        if modules and not any(importlib.util.find_spec(m) for m in modules):
            raise ImportError(f"logger {name} ({node._target_}) needs the {modules[0]} package: "
                              f"pip install 'nmt[{extra}]' (or choose logger=csv)")


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """``cfg.ckpt_path``, with ``latest`` replaced by the newest ``last.ckpt`` of this task's runs."""
    path = cfg.get("ckpt_path")
    if path is None:
        return None
    if path == "latest":
        runs = Path(cfg.paths.log_dir) / cfg.task_name / "runs"
        found = sorted(runs.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise FileNotFoundError(f"ckpt_path=latest: no checkpoint matches {runs}/*/checkpoints/last.ckpt")
        path = str(found[-1])
    elif not Path(path).is_file():
        raise FileNotFoundError(f"ckpt_path={path}: no such file (give <run>/checkpoints/last.ckpt, or latest)")
    log.info("resuming from %s", path)
    return path


def test_checkpoint(cfg: DictConfig, trainer: L.Trainer, ckpt_path: str | None, last: str | None) -> str | None:
    """What the test split is decoded with: the given checkpoint when not training, else the best
    checkpoint by val/bleu (``test_ckpt: best``) or the final weights (``test_ckpt: last``), read
    back from ``last`` (the file ``LastCheckpoint`` wrote) when there is one."""
    if not cfg.get("train", True):
        return ckpt_path
    if cfg.get("test_ckpt", "best") == "last":
        return last
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if not best:
        log.warning("no best checkpoint was saved; testing the final weights")
    return best or last


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name, with its family and model number where Linux gives them (one
    name, e.g. ``AMD EPYC``, covers several generations whose speeds differ)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit and test one model; returns the metrics logged last (``val/bleu``, ``test/bleu``, ...)."""
    L.seed_everything(cfg.seed, workers=True)
    resolve_precision(cfg)
    ckpt_path = resolve_ckpt_path(cfg)
    datamodule = build_datamodule(cfg.data)
    datamodule.setup("fit")
    release_freed_memory()  # the data set-up's temporaries (sorting 10M lengths: ~0.5 GB) are not kept
    model = build_model(cfg, datamodule.src_vocab.vocab_size, datamodule.tgt_vocab.vocab_size)
    allow_pickle = bool(cfg.get("allow_pickle", False))
    if ckpt_path:
        check_resume(ckpt_path, model, datamodule.src_vocab, datamodule.tgt_vocab, allow_pickle)
    module = build_module(cfg, model)
    module.run_config = OmegaConf.to_container(cfg, resolve=True)
    module.tokenizer_protos = tokenizer_protos(datamodule.src_vocab, datamodule.tgt_vocab)
    log.info("model %s: %s parameters", cfg.model._target_, f"{count_parameters(model):,}")

    callbacks = _instantiate_group(cfg.get("callbacks"))
    if not any(isinstance(cb, ScheduleHorizon) for cb in callbacks):  # a budget-bound decay needs it (no-op otherwise)
        callbacks.append(ScheduleHorizon())
    if not cfg.trainer.get("enable_progress_bar", True):  # Lightning refuses a progress bar callback then
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    check_logger_packages(cfg.get("logger"))
    loggers = _instantiate_group(cfg.get("logger"))
    plugins = [*(instantiate(cfg.trainer.get("plugins")) or []), AtomicCheckpointIO()]
    interval = cfg.trainer.get("val_check_interval")
    if isinstance(interval, float) and interval <= 1.0 and cfg.trainer.get("check_val_every_n_epoch") is None:
        with open_dict(cfg):  # a fraction of an epoch: Lightning needs an epoch cadence
            cfg.trainer.check_val_every_n_epoch = 1
    # Without a top-k ModelCheckpoint Lightning would add its own (under the logger's folder);
    # last.ckpt is LastCheckpoint's either way.
    checkpointing = any(isinstance(cb, ModelCheckpoint) for cb in callbacks)
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, plugins=plugins,
                                     enable_checkpointing=checkpointing)
    for logger in loggers:
        logger.log_hyperparams({**module.run_config, "num_parameters": count_parameters(model)})

    start = time.perf_counter()
    stopped_by = None
    if cfg.get("train", True):
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=not allow_pickle)
        except SIGTERMException:
            stopped_by = signal.SIGTERM
        preemption = [cb.signal for cb in callbacks if isinstance(cb, LastCheckpoint) and cb.signal]
        if preemption or trainer.received_sigterm:
            stopped_by = preemption[0] if preemption else signal.SIGTERM
    fit_seconds = time.perf_counter() - start
    train_seconds = train_wall_seconds(trainer, fit_seconds)  # now: testing a checkpoint restores its timer
    end = ended_by(trainer) if cfg.get("train", True) and stopped_by is None else None
    if end == "max_time" and trainer.max_steps > 0:
        log.warning("trainer.max_time (the safety net) stopped training at step %d of its budget of %d "
                    "(trainer.max_steps): this run's results are not the budget's; resume it (ckpt_path=latest) "
                    "or raise trainer.max_time", trainer.global_step, trainer.max_steps)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if stopped_by is not None:  # preempted: no test, and an exit status that says so
        if trainer.is_global_zero:
            write_summary(cfg, module, metrics, (fit_seconds, train_seconds), count_parameters(model), trainer,
                          resumed_from=ckpt_path, stopped_by=signal.Signals(stopped_by).name)
        raise SystemExit(128 + stopped_by)

    tested = None
    if cfg.get("test", False):
        last = next((str(cb.path) for cb in callbacks if isinstance(cb, LastCheckpoint) and cb.step is not None), None)
        counters = {name: getattr(module, name) for name in module.COUNTERS}
        trainer.test(module, datamodule=datamodule, ckpt_path=test_checkpoint(cfg, trainer, ckpt_path, last),
                     weights_only=not allow_pickle)
        for name, value in counters.items():  # loading the tested checkpoint restored its counters: the run's again
            setattr(module, name, value)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
        tested = module.tested_checkpoint()
        log.info("tested %s (step %s)", tested["path"] or "the in-memory weights", tested["step"])
    log.info("metrics: %s", {k: round(v, 4) for k, v in sorted(metrics.items())})
    if trainer.is_global_zero:
        write_summary(cfg, module, metrics, (fit_seconds, train_seconds), count_parameters(model), trainer,
                      resumed_from=ckpt_path, tested=tested, ended_by=end)
        log.info("%s", run_summary(cfg, module, trainer, tested))
    if any(type(logger).__name__ == "WandbLogger" for logger in loggers):
        import wandb

        wandb.finish()  # flush, and let the next run of a sweep start its own
    return metrics


def run_summary(cfg: DictConfig, module, trainer: L.Trainer, tested: dict[str, Any] | None) -> str:
    """What the terminal shows at the end of a run: test scores and the by-length table, where
    the checkpoints and reports are, and the command that translates with the tested weights."""
    out = Path(cfg.paths.output_dir)
    lines = [f"run finished: {out}"]
    results = module.last_results.get("test")
    if results and "report" in results:
        report = results["report"]
        low, high = report["bleu_ci"]
        lines.append(f"test BLEU {report['bleu']:.1f} [{low:.1f}, {high:.1f}], chrF {report['chrf']:.1f} "
                     f"({report['count']} sentences; step {tested['step']})")
        lines.append(markdown_table({"test": report}).rstrip())
        lines.append(f"report: {results['report_paths']['md']} (plot: {results['report_paths']['png']})")
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    last = out / "checkpoints" / "last.ckpt"
    if best:
        lines.append(f"best checkpoint: {best}")
    if last.is_file():
        lines.append(f"final weights: {last}")
    lines.append(f"summary: {out / 'summary.json'}")
    ckpt = (tested or {}).get("path") or (str(last) if last.is_file() else None)
    if ckpt:
        lines.append(f"translate: python translate.py ckpt={ckpt} < input.txt > output.txt")
    return "\n".join(lines)


def train_wall_seconds(trainer: L.Trainer, fit_seconds: float) -> float:
    """Wall-clock training time over the whole run: with a ``max_time`` budget, Lightning's timer
    carries the time of the runs it resumed from; without one, this call's ``fit`` time."""
    timer = budget_timer(trainer)
    return timer.time_elapsed(RunningStage.TRAINING) if timer is not None else fit_seconds


def write_summary(cfg: DictConfig, module, metrics: dict[str, float], seconds: tuple[float, float], params: int, trainer,
                  resumed_from: str | None = None, stopped_by: str | None = None,
                  tested: dict[str, Any] | None = None, ended_by: str | None = None) -> None:
    """``<run>/summary.json``: what a study or sweep table needs from a run; ``seconds``: this
    call's ``fit`` time and the run's training time (``train_wall_seconds``)."""
    fit_seconds, train_seconds = seconds
    summary = {
        "model": cfg.model._target_,
        "encoder": cfg.model.encoder._target_,
        "decoder": cfg.model.decoder._target_,
        "overrides": list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else [],
        "parameters": params,
        "fit_seconds": round(fit_seconds, 1),
        "train_wall_seconds": round(train_seconds, 1),
        "steps": trainer.global_step,
        "max_steps": trainer.max_steps,  # the step budget (-1: none)
        "ended_by": ended_by,  # max_steps | max_time | early_stopping | max_epochs (None: not trained, or stopped_by)
        "epochs": trainer.current_epoch,
        "train_tokens_per_sec": round(module.train_tokens * trainer.world_size / max(module.train_seconds, 1e-9), 1),
        "train_tgt_tokens_per_sec": None if module.train_tgt_tokens is None else  # resumed from an older checkpoint
        round(module.train_tgt_tokens * trainer.world_size / max(module.train_seconds, 1e-9), 1),
        "best_checkpoint": trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else None,
        "tested_checkpoint": tested,  # {"path", "step"} the test metrics were scored with
        "resumed_from": resumed_from,
        "stopped_by": stopped_by,
        "skipped_steps": module.skipped_steps,
        "hardware": {  # what the wall-clock numbers were measured on
            "accelerator": type(trainer.accelerator).__name__, "devices": trainer.num_devices,
            "num_nodes": trainer.num_nodes, "precision": str(trainer.precision),
            "cpu": cpu_name(), "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "metrics": metrics,
    }
    path = Path(cfg.paths.output_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")


def main() -> None:
    """``nmt-train``, ``python train.py``: the config resolvers, then Hydra composes and runs ``run``."""
    register_resolvers()
    run()


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def run(cfg: DictConfig) -> float | None:
    register_resolvers()  # again: a launcher (submitit) may run this in a process of its own
    bound_onednn_cache()
    if kernels.on_cpu(cfg.kernels, training_device(cfg)):
        keep_freed_memory()  # the CPU kernels' allocator setting, for the whole process
    metrics = train(cfg)
    value = metrics.get(cfg.get("optimized_metric") or "")
    return None if value is None or math.isnan(value) else value


if __name__ == "__main__":
    main()

"""Train a model from the Hydra config in ``nmt/conf/train.yaml``: ``python train.py model=transformer``.

``train(cfg)`` builds the data module, the model (its vocabulary sizes read from the trained
SentencePiece models), the ``TranslationModule``, callbacks, loggers and the Trainer
(``nmt.training.builders``); fits; then tests the best checkpoint. It returns the final metrics, which a
sweeper optimises.

``checkpoints/last.ckpt`` holds the final weights whatever ended training, before the test runs;
``summary.json`` and the test report name the checkpoint file and step they scored.
``ckpt_path=<run>/checkpoints/last.ckpt`` (or ``ckpt_path=latest``: the newest ``last.ckpt`` of
``<paths.log_dir>/<task_name>/runs/*``) resumes: weights, optimizer, scheduler, step, epoch, data
position, RNG state and the module's counters; a checkpoint that does not fit the configured model
or vocabulary is refused before training starts. Checkpoints are written atomically
(``trainer.plugins``) and read with ``weights_only=True`` (``allow_pickle=true`` reads trusted
checkpoints of older versions). A run stopped by SIGTERM (or SLURM's SIGUSR1/SIGUSR2) saves
``last.ckpt`` and exits with status 128 + signal.

``init_from=<checkpoint or release file>`` fine-tunes instead: a new run starts from the file's
weights and vocabularies with a fresh optimizer (``init_optimizer=keep``: the file's optimizer
state), schedule, counters and data order; the model config must be the file's architecture
(``nmt.checkpoints.finetune.MAY_DIFFER``). ``ckpt_path`` wins over ``init_from`` (docs/finetuning.md).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities.exceptions import SIGTERMException

from nmt import register_resolvers
from nmt.training.builders import (build_callbacks, build_datamodule, build_loggers, build_model, build_module,
                          build_trainer, compile_plan, count_parameters, trainer_processes)
from nmt.training.batch_probe import CPU_TOKENS, START, probe_max_tokens, training_step_of
from nmt.training.compiling import allow_recompiles, compile_counters, compile_summary
from nmt.data.shapes import bucket, resolve_shapes
from nmt.training.callbacks import LastCheckpoint, budget_timer, ended_by, share_best_with_last
from nmt.cli_io import hydra_command, stop_within_grace
from nmt.checkpoints.finetune import (INIT_OPTIMIZER, check_architecture, check_init_vocabularies, imported_init,
                                     inherit_pruned_heads, init_origin, init_weights, read_init)
from nmt.checkpoints.resume import check_resume
from nmt.checkpoints.files import tokenizer_protos
from nmt.evaluation.length_report import markdown_table
from nmt import kernels
from nmt.kernels.malloc import bound_onednn_cache, keep_freed_memory, release_freed_memory
from nmt.training.cpu_threads import CpuThreads
from nmt.training.lightning_notices import silence_lightning_notices
from nmt.training.guided_alignment import check_guided_alignment
from nmt.machine import cpu_name, resolve_precision, training_device, usable_cores
from nmt.runs.files import CHECKPOINTS, SUMMARY, TEST_TEXT, json_text

log = logging.getLogger(__name__)

MULTILINGUAL = "nmt.data.multilingual.MultilingualSource"


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


def read_init_from(cfg: DictConfig, ckpt_path: str | None) -> dict[str, Any] | None:
    """Fine-tuning (``init_from``): the file's vocabularies become ``data.vocab_from`` unless that is
    set; unless ``ckpt_path`` resumes (it wins), the file is read and its architecture compared
    with ``cfg.model`` before any data is prepared. The checkpoint dict, or None."""
    path, optimizer, weights = cfg.get("init_from"), cfg.get("init_optimizer", "fresh"), cfg.get("init_weights", "stored")
    if optimizer not in INIT_OPTIMIZER:
        raise ValueError(f"init_optimizer={optimizer}: choose {' or '.join(INIT_OPTIMIZER)}")
    if weights not in ("stored", "raw"):
        raise ValueError(f"init_weights={weights}: choose stored or raw")
    if path is None:
        if optimizer == "keep":
            raise ValueError("init_optimizer=keep: there is no optimizer state to keep without init_from=<checkpoint>")
        return None
    path, imported_model = imported_init(str(path), cfg.paths.output_dir, cfg.get("allow_pickle", False))
    if imported_model is not None:  # an imported model (nmt.checkpoints.marian): the run trains its architecture
        log.info("init_from=%s: an imported model; model= is replaced by its architecture", cfg.init_from)
        with open_dict(cfg):
            cfg.init_from, cfg.model = path, OmegaConf.create(imported_model["model"])
            cfg.data.tokenizer.joint = imported_model["joint"]
            cfg.module.report_name = "marian"  # the system's name in the test report (not the replaced preset's)
            multilingual(cfg, imported_model["languages"])
    if cfg.data.get("vocab_from") is None:
        with open_dict(cfg):
            cfg.data.vocab_from = path
    if ckpt_path:
        log.info("ckpt_path=%s resumes its run (weights, optimizer, schedule, counters); init_from=%s gives the "
                 "vocabulary only", ckpt_path, path)
        return None
    checkpoint = read_init(path, optimizer == "keep", cfg.optimizer.get("_target_"))
    with open_dict(cfg):
        if inherited := inherit_pruned_heads(checkpoint, cfg.model, path):
            log.info("init_from=%s: a pruned model; the run keeps its heads per layer: %s", path, " ".join(inherited))
    saved = checkpoint["run_config"]["model"]
    probe = copy.deepcopy(cfg)  # the run's model config with the file's vocabulary sizes, resolved
    with open_dict(probe):
        for key in ("src_vocab_size", "tgt_vocab_size"):
            if key in saved:
                probe.model[key] = saved[key]
    check_architecture(checkpoint, OmegaConf.to_container(probe.model, resolve=True), path)
    log.info("fine-tuning from %s (%s, step %s): a fresh run with its weights%s", path, checkpoint.get("kind", "training"),
             checkpoint.get("global_step"), " and optimizer state" if optimizer == "keep" else "")
    return checkpoint


def multilingual(cfg: DictConfig, languages: dict[str, str] | None) -> None:
    """A run from an imported M2M100, NLLB-200 or mBART-50 model (``languages``: its codes, the
    source's a tag and the target's the decoder's first token) on a multilingual corpus writes the
    languages as the model reads them (``data.source.target_language=decoder_prefix``), and its
    checkpoints translate so (``languages``, which ``nmt.inference.translator`` reads). Other runs
    are left as they are: a Marian model's ``▁<2xx>`` tags start the source as ours do."""
    source = cfg.data.get("source")
    if languages is None or not (OmegaConf.is_dict(source) and source.get("_target_") == MULTILINGUAL):
        return
    log.info("init_from=%s: a model that reads the source language's code and writes the target's first; the "
             "multilingual corpus is written so (data.source.target_language=decoder_prefix)", cfg.init_from)
    cfg.data.source.target_language = "decoder_prefix"
    cfg.languages = dict(languages)


def start_from(cfg: DictConfig, checkpoint: dict[str, Any], model: torch.nn.Module, module: L.LightningModule,
               datamodule: L.LightningDataModule) -> None:
    """Load the ``init_from`` file's weights into ``model`` and tell ``module`` where they came from
    (and, with ``init_optimizer=keep``, the optimizer state its ``configure_optimizers`` takes)."""
    path, weights, optimizer = str(cfg.init_from), cfg.get("init_weights", "stored"), cfg.get("init_optimizer", "fresh")
    check_init_vocabularies(checkpoint, datamodule.src_vocab, datamodule.tgt_vocab, path, cfg.data.vocab_from)
    init_weights(model, checkpoint, path, weights)
    module.init_origin = init_origin(checkpoint, path, weights, optimizer)
    if optimizer == "keep":
        module.init_optimizer_state = checkpoint["optimizer_states"][0]


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


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit and test one model; returns the metrics logged last (``val/bleu``, ``test/bleu``, ...)."""
    L.seed_everything(cfg.seed, workers=True)
    resolve_precision(cfg)
    probe = resolve_batches(cfg)
    plan = compile_plan(cfg)
    if plan is not None:
        allow_recompiles()
    compiled_before = compile_counters() if plan is not None else None
    ckpt_path = resolve_ckpt_path(cfg)
    with stop_within_grace():  # the init_from file read (and imported): a signal stops it within the grace
        init = read_init_from(cfg, ckpt_path)
    weights_only = not cfg.get("allow_pickle", False)
    check_guided_alignment(cfg)
    datamodule = build_datamodule(cfg.data)
    datamodule.setup("fit")
    release_freed_memory()  # the data set-up's temporaries (sorting 10M lengths: ~0.5 GB) are not kept
    if datamodule.val_split != "valid" and cfg.get("train", True):
        log.info("validation during training: a fixed sample of %d of the %d valid pairs (data.val_sample); the "
                 "final weights on all of them after training", len(datamodule.datasets[datamodule.val_split]),
                 len(datamodule.datasets["valid"]))
    model = build_model(cfg, datamodule.src_vocab.vocab_size, datamodule.tgt_vocab.vocab_size)
    module = build_module(cfg, model)  # module.freeze and module.lora apply to the model here
    if ckpt_path:
        with stop_within_grace():  # the checkpoint to resume read whole: the same
            check_resume(ckpt_path, model, datamodule.src_vocab, datamodule.tgt_vocab, not weights_only,
                         str(cfg.optimizer.get("_target_", "")))
    batch_probe = fit_batch_to_device(cfg, model, module, datamodule) if probe else None
    accumulate_to_tokens(cfg)
    if init is not None:
        start_from(cfg, init, model, module, datamodule)
        del init  # the weights are copied into the model; the module holds a kept optimizer state until fit
    module.run_config = OmegaConf.to_container(cfg, resolve=True)
    module.tokenizer_protos = tokenizer_protos(datamodule.src_vocab, datamodule.tgt_vocab)
    params = count_parameters(model)
    log.info("model %s: %s parameters", cfg.model._target_, f"{params:,}")
    callbacks = build_callbacks(cfg)
    loggers = build_loggers(cfg)
    trainer = build_trainer(cfg, callbacks, loggers)
    for logger in loggers:
        logger.log_hyperparams({**module.run_config, "num_parameters": params})

    start = time.perf_counter()
    stopped_by = fit(cfg, trainer, module, datamodule, ckpt_path, weights_only)
    fit_seconds = time.perf_counter() - start
    seconds = (fit_seconds, train_wall_seconds(trainer, fit_seconds))  # now: testing a checkpoint restores its timer
    end = ended_by(trainer) if cfg.get("train", True) and stopped_by is None else None
    if end == "max_time" and trainer.max_steps > 0:
        log.warning("trainer.max_time (the safety net) stopped training at step %d of its budget of %d "
                    "(trainer.max_steps): this run's results are not the budget's; resume it (ckpt_path=latest) "
                    "or raise trainer.max_time", trainer.global_step, trainer.max_steps)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if stopped_by is None:  # Lightning's validate resets the logged metrics: training's are kept here
        try:
            validate_in_full(cfg, trainer, module, datamodule)
        except SIGTERMException:
            stopped_by = signal.SIGTERM
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")})
    if stopped_by is not None:  # preempted: no test, and an exit status that says so
        if trainer.is_global_zero:
            write_summary(cfg, module, metrics, seconds, params, trainer, resumed_from=ckpt_path,
                          stopped_by=signal.Signals(stopped_by).name)
        raise SystemExit(128 + stopped_by)

    last_checkpoint = next((cb for cb in callbacks if isinstance(cb, LastCheckpoint) and cb.step is not None), None)
    # the best file of this fit: testing a checkpoint restores the callbacks' state that file holds
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if cfg.get("train", True) and trainer.is_global_zero and best:
        share_best_with_last(best, last_checkpoint)
    tested = None
    if cfg.get("test", False):
        last = str(last_checkpoint.path) if last_checkpoint is not None else None
        trainer.test(module, datamodule=datamodule, ckpt_path=test_checkpoint(cfg, trainer, ckpt_path, last),
                     weights_only=weights_only, verbose=False)  # the run's summary shows the scores
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
        tested = module.tested_checkpoint()
        log.info("tested %s (step %s)", tested["path"] or "the in-memory weights", tested["step"])
    log.info("metrics: %s", {k: round(v, 4) for k, v in sorted(metrics.items())})
    if trainer.is_global_zero:
        sampler = getattr(datamodule, "_train_sampler", None)
        shapes = len(np.unique(sampler.shapes_of_epoch(0), axis=0)) if sampler is not None else None
        device_use = {"compile": compile_summary(plan, compiled_before, shapes) if compiled_before else None,
                      "shapes": cfg.data.get("shapes"), "batch_probe": batch_probe}
        write_summary(cfg, module, metrics, seconds, params, trainer, resumed_from=ckpt_path, tested=tested, best=best,
                      ended_by=end, device_use=device_use)
        log.info("%s", run_summary(cfg, module, best, tested))
    if any(type(logger).__name__ == "WandbLogger" for logger in loggers):
        import wandb

        wandb.finish()  # flush, and let the next run of a sweep start its own
    return metrics


def resolve_batches(cfg: DictConfig) -> bool:
    """``data.shapes`` and ``data.max_tokens=auto`` for the training device: shape buckets on a GPU
    (exact shapes elsewhere); for ``auto``, the probe's starting batch on a GPU (True: probe it,
    ``fit_batch_to_device``), ``CPU_TOKENS`` on a CPU. ``tf32`` and ``tokens_per_update`` are
    checked here, before any data is read."""
    device = training_device(cfg)
    if not isinstance(cfg.get("tf32", True), bool):
        raise ValueError(f"tf32={cfg.tf32}: true (TF32 matmuls for fp32 on GPUs) or false")
    target = cfg.get("tokens_per_update")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target < 1):
        raise ValueError(f"tokens_per_update={target}: a positive number of tokens per optimizer step, or null")
    if target is not None and cfg.data.get("max_tokens") is None:
        raise ValueError("tokens_per_update needs batches of data.max_tokens tokens (data.batch_size counts sentences)")
    with open_dict(cfg):
        cfg.data.shapes = resolve_shapes(str(cfg.data.get("shapes", "exact")), device)
        if str(cfg.data.get("max_tokens")) != "auto":
            return False
        if device != "cuda":
            log.info("data.max_tokens=auto on a %s: %d tokens a batch (the memory probe runs on GPUs)", device, CPU_TOKENS)
            cfg.data.max_tokens = CPU_TOKENS
            return False
        devices, nodes = str(cfg.trainer.get("devices", 1)), str(cfg.trainer.get("num_nodes", 1))
        if nodes != "1" or devices not in ("1", "auto", "[0]") or (devices == "auto" and torch.cuda.device_count() > 1):
            raise ValueError("data.max_tokens=auto probes one GPU, and each process of a multi-GPU run would find its "
                             "own size: run it once with trainer.devices=1 and set data.max_tokens to the size it logs")
        cfg.data.max_tokens = START
        return True


def fit_batch_to_device(cfg: DictConfig, model: torch.nn.Module, module: L.LightningModule,
                        datamodule: L.LightningDataModule, device: torch.device | None = None) -> dict[str, Any]:
    """``data.max_tokens=auto`` on a GPU (``device``: the current CUDA device): the largest batch of
    the longest training pair that a training step fits in memory (``nmt.training.batch_probe``),
    but no more than ``tokens_per_update`` (a recipe's batch stays its batch on a large GPU), logged;
    the training batches are then cut to it. What was found, for the summary."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    lengths = datamodule.datasets["train"].lengths().max(0).astype(int)  # the longest pair, EOS/BOS included
    widths = (int(lengths[0]), int(lengths[1]))
    if cfg.data.shapes == "buckets":  # both sides padded to the bucket of the longer
        widths = (int(bucket(max(widths))),) * 2
    model.to(device).train()
    step = training_step_of(model, instantiate(cfg.optimizer), lambda batch: module.loss(batch)[0], widths,
                            (model.src_vocab_size, model.tgt_vocab_size), device, str(cfg.trainer.precision))
    found = probe_max_tokens(step, device)
    target = cfg.get("tokens_per_update")
    if target is not None and found["max_tokens"] > target:  # the recipe's tokens per update in one batch, not more
        found.update(max_tokens=max(8, int(target) // 8 * 8), capped_by="tokens_per_update")
    log.info("data.max_tokens=auto: %d tokens a batch (the largest that fit: %d, at %d x %d tokens the longest "
             "pair%s; tries %s)", found["max_tokens"], found["largest_fitting"], *widths,
             ", at most tokens_per_update" if "capped_by" in found else "",
             ", ".join(f"{t}{'' if ok else ' (out of memory)'}" for t, ok in found["tries"]))
    datamodule.set_max_tokens(found["max_tokens"])
    with open_dict(cfg):
        cfg.data.max_tokens = found["max_tokens"]
    return {**found, "widths": list(widths)}


def accumulate_to_tokens(cfg: DictConfig) -> None:
    """``tokens_per_update``: accumulate enough batches of ``data.max_tokens`` (on every process) for
    an optimizer step to see about that many tokens, as the Transformer's recipe counts its ~25k
    (Vaswani et al. 2017, sec. 5.1); sets ``trainer.accumulate_grad_batches``, logged. The processes
    are those the Trainer will run (``trainer_processes``: ``trainer.devices`` in any of its forms,
    times ``trainer.num_nodes``)."""
    target = cfg.get("tokens_per_update")  # checked by resolve_batches
    if target is None:
        return
    world = trainer_processes(cfg.trainer)
    steps = max(1, round(target / (int(cfg.data.max_tokens) * world)))
    with open_dict(cfg):
        cfg.trainer.accumulate_grad_batches = steps
    log.info("tokens_per_update=%d: %d batch(es) of %d tokens on %d process(es) per optimizer step (%d tokens)",
             target, steps, int(cfg.data.max_tokens), world, steps * int(cfg.data.max_tokens) * world)


def fit(cfg: DictConfig, trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule,
        ckpt_path: str | None, weights_only: bool) -> int | None:
    """``trainer.fit`` unless ``train=false``; the signal that stopped it (SIGTERM, or the SLURM
    signal ``LastCheckpoint`` received), None when training ended by itself."""
    if not cfg.get("train", True):
        return None
    stopped_by = None
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=weights_only)
    except SIGTERMException:
        stopped_by = signal.SIGTERM
    preemption = [cb.signal for cb in trainer.callbacks if isinstance(cb, LastCheckpoint) and cb.signal]
    if preemption or trainer.received_sigterm:
        stopped_by = preemption[0] if preemption else signal.SIGTERM
    return stopped_by


def validate_in_full(cfg: DictConfig, trainer: L.Trainer, module: L.LightningModule,
                     datamodule: L.LightningDataModule) -> None:
    """After a training run that validated on a sample (``data.val_sample``), validate its final
    weights on every valid pair: ``val/bleu`` and ``val/chrf`` then score the whole split."""
    if (not cfg.get("train", True) or not trainer.limit_val_batches or trainer.fast_dev_run
            or trainer.overfit_batches or not module.validations or not datamodule.validate_in_full()):
        return
    log.info("validating the final weights on all %d valid pairs", len(datamodule.datasets["valid"]))
    trainer.validate(module, datamodule=datamodule, verbose=False)


def validation_summary(module: L.LightningModule, datamodule: L.LightningDataModule) -> dict[str, Any]:
    """What validation decoded and what it cost: the sample (or every pair) during training, each
    validation of this process, and the final one on every pair where a sample came first."""
    runs = list(module.validations)
    full = len(datamodule.datasets["valid"]) if "valid" in datamodule.datasets else None
    sample = datamodule.datasets.get("valid_sample")
    during = len(sample) if sample is not None else full
    return {"sentences": full, "during_training": during,
            "seconds": round(sum(r["seconds"] for r in runs), 1), "runs": runs, "best_chosen": best_chosen(runs, during)}


def best_chosen(runs: list[dict[str, Any]], sentences: int | None) -> dict[str, Any] | None:
    """How "best" was chosen: the validations during training, all on the same ``sentences``
    (the final weights among them: ``LastCheckpoint`` stops the fit there, and Lightning then
    validates), the best of them and the final one."""
    during = [r for r in runs if r["sentences"] == sentences]  # not the final weights on every pair after it
    if not during:
        return None
    best = max(during, key=lambda r: r["bleu"])  # the first of equal scores, as ModelCheckpoint keeps it
    return {"sentences": sentences, "steps": [r["step"] for r in during],
            "best": {"step": best["step"], "bleu": best["bleu"]},
            "final": {"step": during[-1]["step"], "bleu": during[-1]["bleu"]}}


def run_summary(cfg: DictConfig, module, best: str, tested: dict[str, Any] | None) -> str:
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
        lines.append(markdown_table({report_name(module): report}).rstrip())
        lines.append(f"report: {results['report_paths']['md']} (plot: {results['report_paths']['png']})")
    last = out / CHECKPOINTS / "last.ckpt"
    if best:
        lines.append(f"best checkpoint: {best}")
    if last.is_file():
        lines.append(f"final weights: {last}")
    lines.append(f"summary: {out / SUMMARY}")
    ckpt = (tested or {}).get("path") or (str(last) if last.is_file() else None)
    sources = Path(results["report_paths"]["md"]).parent / TEST_TEXT.format("sources") if results and "report_paths" in results else None
    if results and results.get("sources"):
        lines.append("three test sentences and their translations" + (f" (all the sources: {sources})" if sources else "") + ":")
        lines += [f"  {results['sources'][i]}\n  -> {results['hyps'][i]}" for i in example_lines(results["sources"])]
    if ckpt:
        lines.append(f"translate: nmt-translate ckpt={ckpt} < input.txt > output.txt")
        if sources is not None and sources.is_file():
            lines.append(f"  for example: nmt-translate ckpt={ckpt} < {sources} > translations.txt")
    return "\n".join(lines)


def example_lines(sources: list[str], count: int = 3, longest: int = 15) -> list[int]:
    """Indices of ``count`` test sentences to show: the first ones of at most ``longest`` words
    (short lines read at a glance), else the first ones."""
    short = [i for i, line in enumerate(sources) if 0 < len(line.split()) <= longest]
    return (short or list(range(len(sources))))[:count]


def report_name(module: L.LightningModule) -> str:
    """The system's name in the test report (``module.report_name``), as ``write_test_report`` names it."""
    return module.hparams.get("report_name") or type(module.model.decoder).__name__


def train_wall_seconds(trainer: L.Trainer, fit_seconds: float) -> float:
    """Wall-clock training time over the whole run: with a ``max_time`` budget, Lightning's timer
    carries the time of the runs it resumed from; without one, this call's ``fit`` time."""
    timer = budget_timer(trainer)
    return timer.time_elapsed(RunningStage.TRAINING) if timer is not None else fit_seconds


def test_scores(module) -> dict[str, Any] | None:
    """The test's BLEU and its 95% bootstrap interval, chrF and the sentences scored (None: no test report)."""
    report = (getattr(module, "last_results", {}).get("test") or {}).get("report")
    if not report:
        return None
    return {"bleu": round(report["bleu"], 2), "bleu_ci": [round(v, 2) for v in report["bleu_ci"]],
            "chrf": round(report["chrf"], 2), "sentences": report["count"]}


def write_summary(cfg: DictConfig, module, metrics: dict[str, float], seconds: tuple[float, float], params: int, trainer,
                  resumed_from: str | None = None, stopped_by: str | None = None,
                  tested: dict[str, Any] | None = None, ended_by: str | None = None,
                  device_use: dict[str, Any] | None = None, best: str | None = None) -> None:
    """``<run>/summary.json``: what a study or sweep table needs from a run; ``seconds``: this
    call's ``fit`` time and the run's training time (``train_wall_seconds``)."""
    fit_seconds, train_seconds = seconds
    summary = {
        "model": cfg.model._target_,
        "encoder": cfg.model.encoder._target_,
        "decoder": cfg.model.decoder._target_,
        "overrides": list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else [],
        "parameters": params,
        "trained_parameters": module.trainable["trained"],  # less with module.freeze, module.lora (adapters only)
        "fit_seconds": round(fit_seconds, 1),
        "train_wall_seconds": round(train_seconds, 1),
        "steps": trainer.global_step,
        "max_steps": trainer.max_steps,  # the step budget (-1: none)
        "ended_by": ended_by,  # max_steps | max_time | pruned | early_stopping | max_epochs (None: not trained, or stopped_by)
        "epochs": trainer.current_epoch,
        "train_tokens_per_sec": round(module.train_tokens * trainer.world_size / max(module.train_seconds, 1e-9), 1),
        "train_tgt_tokens_per_sec": None if module.train_tgt_tokens is None else  # resumed from an older checkpoint
        round(module.train_tgt_tokens * trainer.world_size / max(module.train_seconds, 1e-9), 1),
        "best_checkpoint": best if best is not None else  # after a test, best_model_path is its file's record
        (trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else None),
        "tested_checkpoint": tested,  # {"path", "step"} the test metrics were scored with
        "test": test_scores(module),  # BLEU with its 95% bootstrap interval, chrF, sentences
        "resumed_from": resumed_from,
        "init_from": module.init_origin,  # what a fine-tuning run started from (None: fresh weights)
        "stopped_by": stopped_by,
        "skipped_steps": module.skipped_steps,
        "validation": validation_summary(module, trainer.datamodule) if trainer.datamodule is not None else None,
        "hardware": {  # what the wall-clock numbers were measured on
            "accelerator": type(trainer.accelerator).__name__, "devices": trainer.num_devices,
            "num_nodes": trainer.num_nodes, "precision": str(trainer.precision),
            "cpu": cpu_name(), "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "usable_cores": usable_cores(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        # time on each thread count where other programs shared the CPU (nmt.training.cpu_threads)
        "cpu_threads": next((cb.summary() for cb in trainer.callbacks if isinstance(cb, CpuThreads)), None),
        "metrics": metrics,
        # data.shapes, what compiling cost (compile) and the batch data.max_tokens=auto found (batch_probe)
        "device_use": device_use,
    }
    path = Path(cfg.paths.output_dir) / SUMMARY
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_text(summary))


def set_up_process(cfg: DictConfig) -> None:
    """The process-wide settings a training run wants (also ``nmt-distill``'s)."""
    register_resolvers()  # again: a launcher (submitit) may run this in a process of its own
    silence_lightning_notices()
    bound_onednn_cache()
    device = training_device(cfg)
    if kernels.on_cpu(cfg.kernels, device):
        keep_freed_memory()  # the CPU kernels' allocator setting, for the whole process
    if device == "cuda":  # TF32 matmuls for fp32 (torch's default is full fp32 for matmuls); a tf32 that is
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.get("tf32", True) is True
        # not a boolean is refused by resolve_batches, in train()


def optimized_value(cfg: DictConfig, metrics: dict[str, float]) -> float | None:
    """The value of ``cfg.optimized_metric`` a sweeper optimizes (None: not set, not measured, or NaN)."""
    value = metrics.get(cfg.get("optimized_metric") or "")
    return None if value is None or math.isnan(value) else value


def run_training(cfg: DictConfig) -> float | None:
    """``train(cfg)``; the metric a sweeper optimizes (``optimized_value``)."""
    return optimized_value(cfg, train(cfg))


main = hydra_command("train", run_training, set_up_process)  # nmt-train, python train.py: nmt/conf/train.yaml


if __name__ == "__main__":
    main()

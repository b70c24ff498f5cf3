"""Prune a Transformer's attention heads by importance, level by level (Michel et al. 2019):

    nmt-prune ckpt=<file> levels=[0,0.2,0.4,0.6,0.8] [out=<folder>] [data=<name>]

Each head's importance (``nmt.evaluation.heads.importance``: the mean absolute gradient of the
loss with respect to a mask on the head's output, normalised per layer) is measured once, on the
first ``importance_pairs`` pairs of ``importance_split`` (the validation split). At each level the
share of all heads with the lowest importance is pruned (``nmt.models.head_mask.least_important``:
every attention keeps one head at least) and removed from the weights
(``nmt.models.head_mask.prune``); the pruned model translates the test split, and its BLEU and
chrF overall and by source length (``nmt.evaluation.length_report``), its size and its decoding
speed are written. Per level: ``level_<percent>/`` with the report, the translations and
``pruned.ckpt``, a release file whose config carries the heads per layer (``self_heads``,
``cross_heads``), read by every command. Over all levels: ``pruning.{json,md}``.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nmt.checkpoints.files import atomic_save, read_checkpoint
from nmt.checkpoints.release import release
from nmt.cli_io import hydra_command, stop_within_grace
from nmt.evaluate import load_data
from nmt.evaluation import directions, heads
from nmt.evaluation.length_report import bleu_cell, length_buckets, length_report, write_report
from nmt.inference.translator import Translator
from nmt.models import head_mask
from nmt.runs.files import json_text

log = logging.getLogger(__name__)
WARM_UP = 16  # sentences each level translates before it is timed


def pruned_release(checkpoint: dict[str, Any], source: str, model: Any, level: float,
                   kept: dict[str, list[list[int]]]) -> dict[str, Any]:
    """A release file of ``checkpoint``'s run with the pruned ``model``'s weights and head counts
    (``kept``: the original heads each layer kept, recorded beside them)."""
    result = release(checkpoint, source, report=None, pruned={"level": level, "kept": kept})
    run_config = dict(result["run_config"])
    run_config["model"] = head_mask.pruned_config(run_config["model"], head_mask.head_counts(model))
    result["run_config"] = run_config
    result["state_dict"] = {f"model.{k}": v for k, v in model.state_dict().items()}
    return result


def levels_of(value: Any) -> list[float]:
    """The pruning levels, shares of the heads from 0 up to 1, increasing; a one-line ValueError else."""
    levels = list(value or [])
    if not levels or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1 for v in levels) \
            or sorted(set(levels)) != levels:
        raise ValueError(f"levels={levels}: increasing shares of the heads to prune, each from 0 up to (not including) 1")
    return [float(v) for v in levels]


def count_of(value: Any, key: str, none: bool = False) -> int | None:
    """A number of pairs (at least 1; None where ``none``); a one-line ValueError naming ``key`` else."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: a number of pairs, at least 1{' (null: all)' if none else ''}")
    return value


def run_prune(cfg: DictConfig) -> Path:
    levels = levels_of(OmegaConf.to_container(cfg.levels) if cfg.get("levels") is not None else None)
    pairs, held_pairs = count_of(cfg.get("pairs"), "pairs", none=True), count_of(cfg.importance_pairs, "importance_pairs")
    count_of(cfg.batch_size, "batch_size")
    out = Path(cfg.out) if cfg.get("out") else Path(cfg.paths.output_dir)
    source = str(cfg.ckpt)
    with stop_within_grace():  # a signal stops the model's load within the grace, before anything is written
        translator = Translator.load(source, device=str(cfg.device), kernels=str(cfg.kernels), precision="32",
                                     allow_pickle=cfg.allow_pickle, decoding=OmegaConf.to_container(cfg.decoding),
                                     max_tokens=cfg.max_tokens)
        if not heads.has_heads(translator.model):
            raise ValueError(f"ckpt={source}: a model without Transformer attention heads; nothing to prune")
        checkpoint = read_checkpoint(source, cfg.allow_pickle)
    data_cfg, data_source = cfg.get("data"), None
    if data_cfg is None:
        data_cfg, data_source = translator.run_config.get("data"), source
        data_cfg = {**data_cfg, "cache_dir": str(cfg.paths.cache_dir)}
    test_data = load_data(data_cfg, data_source, str(cfg.split))
    sources, refs = (lines[:pairs] for lines in test_data.raw(str(cfg.split)))
    options, _ = directions.report_options(test_data, cfg.length_buckets, cfg.sacrebleu_tokenize)
    edges = length_buckets(cfg.length_buckets, options["unit"])
    held = load_data(data_cfg, data_source, str(cfg.importance_split))
    held_sources, held_refs = (lines[:held_pairs] for lines in held.raw(str(cfg.importance_split)))
    scores = heads.importance(translator.model, (b for b, _, _ in heads.teacher_forced_batches(
        translator, held_sources, held_refs, int(cfg.batch_size))))
    total = sum(len(s) for layers in scores.values() for s in layers)
    rows = []
    for level in levels:
        model = copy.deepcopy(translator.model)
        kept = head_mask.least_important(scores, level)
        head_mask.prune(model, kept)
        pruned = Translator(model, translator.src_vocab, translator.tgt_vocab, translator.run_config, precision="32",
                            decoding=translator.settings, max_tokens=int(cfg.max_tokens))
        pruned.translate(list(sources[:WARM_UP]))  # every level timed after the same warm-up (kernel caches)
        start = time.perf_counter()
        hyps = [t.text for t in pruned.translate(list(sources))]
        seconds = time.perf_counter() - start
        folder = out / f"level_{round(100 * level):02d}"
        report = length_report(sources, hyps, refs, edges, unit=options["unit"], tokenize=options["tokenize"],
                               n_bootstrap=cfg.n_bootstrap)
        counts = head_mask.head_counts(model)
        report.update(pruning_level=level, heads=counts, translation_seconds=round(seconds, 3))
        write_report(report, folder, name=f"{round(100 * level)}% of heads pruned")
        (folder / "hyp.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        atomic_save(pruned_release(checkpoint, source, model, level, kept), folder / "pruned.ckpt")
        kept = sum(sum(layers) for layers in counts.values())
        rows.append({"level": level, "heads": kept, "of": total, "parameters": sum(p.numel() for p in model.parameters()),
                     "bleu": report["bleu"], "bleu_ci": report["bleu_ci"], "chrf": report["chrf"],
                     "by_length": {b["label"]: b["bleu"] for b in report["buckets"]},
                     "seconds": round(seconds, 3), "sentences_per_second": round(len(sources) / max(seconds, 1e-9), 2),
                     "checkpoint": str(folder / "pruned.ckpt")})
        log.info("%d%% of heads pruned (%d of %d kept): BLEU %.2f, %.2f s", round(100 * level), kept, total,
                 report["bleu"], seconds)
    for row in rows:
        row["speed_vs_full"] = round(rows[0]["seconds"] / max(row["seconds"], 1e-9), 3)
    (out / "pruning.json").write_text(json_text({"ckpt": source, "split": str(cfg.split), "pairs": len(sources),
                                                 "importance_split": str(cfg.importance_split),
                                                 "importance_pairs": len(held_sources), "levels": rows}))
    labels = list(rows[0]["by_length"])
    lines = ["| pruned | heads | parameters | BLEU [95% CI] | chrF | " + " | ".join(f"BLEU {b}" for b in labels)
             + " | seconds | speed vs first level |", "|---:|---:|---:|---|---:|" + "---:|" * (len(labels) + 2)]
    for r in rows:
        lines.append(f"| {round(100 * r['level'])}% | {r['heads']}/{r['of']} | {r['parameters']:,} | "
                     f"{bleu_cell(r['bleu'], *r['bleu_ci'])} | {r['chrf']:.2f} | "
                     + " | ".join("" if r["by_length"][b] is None else f"{r['by_length'][b]:.2f}" for b in labels)
                     + f" | {r['seconds']:.2f} | {r['speed_vs_full']:.2f}x |")
    path = out / "pruning.md"
    path.write_text("\n".join(lines) + "\n")
    log.info("pruning -> %s\n%s", path, path.read_text())
    return path


main = hydra_command("prune", run_prune)  # nmt-prune: nmt/conf/prune.yaml

if __name__ == "__main__":
    main()

"""Average the weights of several checkpoints of one run into a release file (Vaswani et al. 2017
averaged the last 5 or 20 checkpoints; fairseq, Marian and OpenNMT-py have the same tool):

    nmt-average run=<run folder> last=5          # the 5 checkpoints with the highest steps
    nmt-average run=<run folder> best=3          # the 3 with the best validation score
    nmt-average ckpts=[a.ckpt,b.ckpt] out=avg.ckpt

``last=N`` takes the newest N of the evenly spaced checkpoints a run keeps with
``callbacks=[default,recent_checkpoints]`` (``<run>/checkpoints/recent/``; without them, of all its
checkpoints); ``best=N`` the N of all ``<run>/checkpoints/**/*.ckpt`` (top-k by val/bleu,
``last.ckpt``, ...) with the highest validation score of their own weights (saved at the step of
that validation); one checkpoint per step. In a run with ``callbacks.ema`` validation scores the
averaged weights, and ``recent/`` files hold only the raw ones. ``weights=raw`` (default) averages the weights being trained, also in a run with
``callbacks.ema`` (whose checkpoints store the moving average). Floating-point weights are averaged in fp64; integer buffers come from the newest
checkpoint. The output (default ``<run>/checkpoints/average_{last,best}<N>.ckpt``) is a release file
for ``translate.py`` and ``evaluate.py``; the checkpoints must share the model config and vocabularies.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from nmt.cli_io import hydra_command, stop_within_grace
from nmt.checkpoints.files import (CheckpointError, atomic_save, check_run_config, merged_weights, nonfinite,
                                  read_checkpoint)
from nmt.checkpoints.release import release
from nmt.runs.files import CHECKPOINTS

log = logging.getLogger(__name__)


def candidates(run: Path, allow_pickle: bool = False, recent: bool = False) -> list[tuple[Path, dict[str, Any]]]:
    """The run's checkpoints (``recent``: those of ``checkpoints/recent/`` if there are any), one
    per global step (the first found of equal steps), by step."""
    folder = run / CHECKPOINTS
    if not folder.is_dir():
        raise FileNotFoundError(f"run={run}: no checkpoints/ folder (give the run's output folder)")
    if recent and any((folder / "recent").glob("*.ckpt")):
        folder = folder / "recent"
    by_step: dict[int, tuple[Path, dict[str, Any]]] = {}
    for path in sorted(folder.rglob("*.ckpt")):
        checkpoint = read_checkpoint(path, allow_pickle, what="run")
        if checkpoint.get("kind") == "release":  # an earlier average or export
            continue
        by_step.setdefault(int(checkpoint["global_step"]), (path, checkpoint))
    return [by_step[step] for step in sorted(by_step)]


def select(found: list[tuple[Path, dict[str, Any]]], last: int | None, best: int | None) -> list[tuple[Path, dict[str, Any]]]:
    """The ``last`` highest steps or the ``best`` validation scores (``monitor`` saved in each)."""
    if (last is None) == (best is None):
        raise ValueError("give exactly one of last=N or best=N")
    n = last if last is not None else best
    if n < 1:
        raise ValueError(f"{'last' if last is not None else 'best'}={n}: must be at least 1")
    if last is not None:
        chosen = found[-last:]
    else:
        # a saved score is these weights' own only when it was computed at the checkpoint's step
        scored = [(p, c) for p, c in found if (c.get("monitor") or {}).get("value") is not None
                  and c["monitor"].get("step") == c["global_step"]]
        chosen = sorted(scored, key=lambda pc: pc[1]["monitor"]["value"], reverse=True)[:best]
    if len(chosen) < n:
        raise ValueError(f"asked for {n} checkpoints but only {len(chosen)} qualify "
                         f"({len(found)} found, one per step{'; with a validation score' if best else ''}): "
                         "keep more with callbacks=[default,recent_checkpoints] or ask for fewer")
    return sorted(chosen, key=lambda pc: pc[1]["global_step"])


def average(checkpoints: list[tuple[Path, dict[str, Any]]], weights: str = "raw") -> dict[str, torch.Tensor]:
    """The mean of the checkpoints' model weights (fp64 sums, cast back); all must have the same
    model config, vocabularies and weight names/shapes, else a ValueError names the file."""
    for path, c in checkpoints:  # a config from a file is bounded before anything reads it whole
        check_run_config(c, path)
    first_path, first = checkpoints[0]
    states = [merged_weights(c, weights, path) for path, c in checkpoints]  # a LoRA run's: adapters merged
    for (path, c), state in zip(checkpoints[1:], states[1:]):
        if c["run_config"].get("model") != first["run_config"].get("model") or c["tokenizers"] != first["tokenizers"]:
            raise ValueError(f"{path}: another model config or vocabulary than {first_path}; average checkpoints of one run")
        if {k: v.shape for k, v in state.items()} != {k: v.shape for k, v in states[0].items()}:
            raise ValueError(f"{path}: its weights differ in names or shapes from {first_path}")
    averaged: dict[str, torch.Tensor] = {}
    shared: dict[tuple, torch.Tensor] = {}  # tied weights (one storage) stay one tensor
    for name, newest in states[-1].items():
        key = (newest.untyped_storage().data_ptr(), newest.storage_offset(), tuple(newest.shape), newest.dtype)
        if key not in shared:
            if newest.is_floating_point():
                shared[key] = (sum(s[name].double() for s in states) / len(states)).to(newest.dtype)
            else:
                shared[key] = newest.clone()
        averaged[name] = shared[key]
    if bad := nonfinite(averaged.items()):
        sources = [str(path) for (path, _), state in zip(checkpoints, states) if nonfinite(state.items())]
        raise ValueError(f"the average holds NaN or infinity ({', '.join(k.removeprefix('model.') for k in bad[:5])}), "
                         f"from {', '.join(sources) or 'an overflow'}; leave such checkpoints out")
    return averaged


def run_average(cfg: DictConfig) -> Path:
    """Read, check and average the checkpoints (a signal stops it within the grace: nothing is
    written), then write the release file."""
    with stop_within_grace():
        chosen, out = chosen_checkpoints(cfg)
        state = average(chosen, cfg.weights)
    newest_path, newest = chosen[-1]
    result = release(newest, newest_path, cfg.weights, report=None,  # the run's test report is not of the average
                     averaged_from=[{"path": str(p), "step": c.get("global_step")} for p, c in chosen])
    result["state_dict"] = state
    atomic_save(result, out)
    log.info("averaged %d checkpoints (steps %s) -> %s", len(chosen), [c.get("global_step") for _, c in chosen], out)
    return out


def chosen_checkpoints(cfg: DictConfig) -> tuple[list[tuple[Path, dict[str, Any]]], Path]:
    """The checkpoints ``cfg`` names, read and ordered by step, and the file to write."""
    if cfg.get("ckpts"):
        paths = [Path(p) for p in cfg.ckpts]
        chosen = [(p, read_checkpoint(p, cfg.allow_pickle, what="ckpts")) for p in paths]
        chosen.sort(key=lambda pc: pc[1].get("global_step") or 0)
        default_out = None
    elif cfg.get("run"):
        found = candidates(Path(cfg.run), cfg.allow_pickle, recent=cfg.get("last") is not None)
        chosen = select(found, cfg.get("last"), cfg.get("best"))
        default_out = Path(cfg.run) / CHECKPOINTS / (f"average_last{cfg.last}.ckpt" if cfg.get("last") else
                                                       f"average_best{cfg.best}.ckpt")
    else:
        raise ValueError("nothing to average: set run=<run folder> with last=N or best=N, or ckpts=[a.ckpt,b.ckpt]")
    out = Path(cfg.out) if cfg.get("out") else default_out
    if out is None:
        raise ValueError("ckpts=[...]: set out=<file> for the averaged checkpoint")
    if len(chosen) < 2:
        raise CheckpointError("averaging needs at least two checkpoints")
    return chosen, out


main = hydra_command("average", run_average)  # nmt-average: nmt/conf/average.yaml

if __name__ == "__main__":
    main()

"""Part 5 of the GPU check: peak memory, bytes saved for backward and step time of a few training
steps with ``model.gradient_checkpointing`` false then true, the same weights and batches:
transformer_base and lstm_bahdanau."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any

import torch

from nmt.bench.gpu.check import Check
from nmt.bench.measure import SavedBytes, peak_memory_mb, reset_peak_memory, sync, to_device
from nmt.training.builders import build_model, build_module


def checkpointing(check: Check, result: dict[str, Any]) -> None:
    rows = result.setdefault("runs", [])
    check.per_preset(rows, ("transformer_base", "lstm_bahdanau"), lambda preset: _memory(check, preset),
                     lambda preset, r: f"checkpointing {preset}: peak {r['off']['peak_mb']:,.0f} -> {r['on']['peak_mb']:,.0f} MB, "
                                       f"saved for backward {r['off']['saved_mb']:,.1f} -> {r['on']['saved_mb']:,.1f} MB")
    if any("error" in r for r in rows):
        raise RuntimeError("; ".join(f"{r['model']}: {r['error']}" for r in rows if "error" in r))


def _memory(check: Check, preset: str) -> dict[str, Any]:
    cfg = check.preset_config(preset, f"memory-{preset}")
    dm = check.datamodule(cfg)
    loader = iter(dm.train_dataloader())
    batches = [to_device(next(loader), check.device) for _ in range(check.mode.memory_steps)]
    torch.manual_seed(0)
    model = build_model(cfg, dm.src_vocab.vocab_size, dm.tgt_vocab.vocab_size)
    module = build_module(cfg, model).to(check.device).train()
    state = copy.deepcopy(module.state_dict())
    autocast = check.autocast()
    tokens = sum(b["num_src_tokens"] + b["num_tgt_tokens"] for b in batches)
    row: dict[str, Any] = {"model": preset, "steps": len(batches), "tokens": tokens}
    for enabled in (False, True):  # the plain run first: on a CPU the peak RSS only grows
        module.load_state_dict(state)
        model.set_gradient_checkpointing(enabled)
        optimizer = module.configure_optimizers()
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        check.free()
        reset_peak_memory(check.device)
        before = torch.cuda.memory_allocated(check.device) / 2**20 if check.mode.cuda else None
        saved = SavedBytes()
        sync(check.device)
        start = time.perf_counter()
        for i, batch in enumerate(batches):
            hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t) if i == 0 else contextlib.nullcontext()
            with hooks, autocast():
                loss, _ = module.loss(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync(check.device)
        row["on" if enabled else "off"] = {
            "peak_mb": peak_memory_mb(check.device), "allocated_before_mb": before,
            "saved_mb": saved.total / 2**20, "step_ms": 1000 * (time.perf_counter() - start) / len(batches),
        }
        del optimizer
    model.set_gradient_checkpointing(False)
    row["peak_cut"] = 1 - row["on"]["peak_mb"] / row["off"]["peak_mb"]
    if check.mode.cuda:  # what the steps added to the weights (and what else was allocated before)
        above = {k: row[k]["peak_mb"] - row[k]["allocated_before_mb"] for k in ("off", "on")}
        row["peak_above_start_cut"] = 1 - above["on"] / above["off"] if above["off"] > 0 else None
    row["saved_cut"] = 1 - row["on"]["saved_mb"] / row["off"]["saved_mb"] if row["off"]["saved_mb"] else None
    row["memory"] = "CUDA max_memory_allocated" if check.mode.cuda else "peak RSS (coarse: the allocator keeps freed memory)"
    return row

"""Part 7 of the GPU check: loss parity. For a fixed batch and weights (seeded, then a few Adam steps
on that batch so that the predictions are no longer uniform), ``module.loss`` with
``kernels=reference`` on the CPU in fp32 against the same weights on the device with the training
default ``kernels=auto``, in fp32 (TF32 off) and under bf16 autocast, per preset."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from nmt.bench.gpu.check import Check
from nmt.bench.gpu.training import PRESETS
from nmt.bench.measure import to_device
from nmt.training.builders import build_model, build_module
from nmt.specials import PAD

PARITY_SENTENCES, PARITY_STEPS = 48, 5
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}  # relative difference of the loss


def first_sentences(batch: dict[str, Any], n: int) -> dict[str, Any]:
    """The batch's first ``n`` sentence pairs, token counts updated."""
    out = {k: v[:n] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out["num_src_tokens"] = int(out["src_mask"].sum())
    out["num_tgt_tokens"] = int((out["tgt_out"] != PAD).sum())
    return out


def parity(check: Check, result: dict[str, Any]) -> None:
    rows = result.setdefault("runs", [])
    result["tolerance"] = TOLERANCE
    dm = check.datamodule()
    batch = first_sentences(next(iter(dm.train_dataloader())), PARITY_SENTENCES)
    result["batch"] = {"sentences": int(batch["src"].size(0)), "src_tokens": batch["num_src_tokens"],
                       "tgt_tokens": batch["num_tgt_tokens"], "training_steps": PARITY_STEPS}
    check.per_preset(rows, PRESETS, lambda preset: _parity(check, preset, batch, dm),
                     lambda preset, r: f"parity {preset}: fp32 {r['fp32']['rel_diff']:.2e} ({'pass' if r['fp32']['pass'] else 'FAIL'}), "
                                       f"bf16 {r['bf16']['rel_diff']:.2e} ({'pass' if r['bf16']['pass'] else 'FAIL'})",
                     min_left=3, free=False)
    result["passed"] = all(r.get("fp32", {}).get("pass") and r.get("bf16", {}).get("pass") for r in rows)
    if any("error" in r for r in rows):
        raise RuntimeError("; ".join(f"{r['model']}: {r['error']}" for r in rows if "error" in r))


def _parity(check: Check, preset: str, batch: dict[str, Any], dm) -> dict[str, Any]:
    cfg = check.preset_config(preset, f"parity-{preset}", ["kernels=reference"])
    torch.manual_seed(0)
    module = build_module(cfg, build_model(cfg, dm.src_vocab.vocab_size, dm.tgt_vocab.vocab_size))
    # A few Adam steps on the batch first: from the initial weights every model predicts nearly
    # uniformly, and any computation of a near-uniform softmax gives nearly the same loss.
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    module.eval()  # no dropout: the same function on both devices
    for _ in range(PARITY_STEPS):
        module.loss(batch)[0].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        reference = float(module.loss(batch)[0])
    device_module = copy.deepcopy(module).to(check.device)
    device_module.model.set_kernels("auto")  # what training uses there: plain PyTorch on a GPU, the CPU kernels on a CPU
    on_device = to_device(batch, check.device)
    row: dict[str, Any] = {"model": preset, "cpu_fp32_reference": reference,
                           "device": f"{check.device.type}, kernels=auto"}
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 here
        with torch.no_grad():
            fp32 = float(device_module.loss(on_device)[0])
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    with torch.no_grad(), check.autocast()():
        bf16 = float(device_module.loss(on_device)[0])
    for name, value in (("fp32", fp32), ("bf16", bf16)):
        rel = abs(value - reference) / max(abs(reference), 1e-12)
        row[name] = {"loss": value, "abs_diff": abs(value - reference), "rel_diff": rel,
                     "tolerance": TOLERANCE[name], "pass": math.isfinite(value) and rel <= TOLERANCE[name]}
    return row

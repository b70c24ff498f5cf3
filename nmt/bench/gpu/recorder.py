"""The training callback of the GPU check's trainings: ``StepRecorder`` times each batch (the device
synchronized) and keeps its real lengths, the loss and the GradScaler's scale, and sums them up into
tokens/s and model FLOP/s. ``train()`` builds it from the config's ``_target_``, ``recorder``, which
hands out the one registered in ``RECORDERS``."""

from __future__ import annotations

import math
import time
from typing import Any

import pytorch_lightning as L
import torch

from nmt.bench.flops import Lengths, training_flops
from nmt.bench.measure import peak_memory_mb, reset_peak_memory, sync

RECORDERS: dict[str, "StepRecorder"] = {}


def recorder(key: str) -> "StepRecorder":
    """The callback ``train()`` instantiates from ``callbacks.gpu_check._target_``
    (``nmt.bench.gpu.recorder.recorder``): the recorder registered under ``key`` before the training."""
    return RECORDERS[key]


class StepRecorder(L.Callback):
    """Per training batch: the end time (device synchronized), the real lengths (kept as device
    tensors, summed at the end) and the loss scale; the peak memory and the model at the end."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.ends: list[float] = []
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.loss: torch.Tensor | None = None
        self.scaler = None
        self.scales: list[float] = []
        self.model: torch.nn.Module | None = None
        self.peak_mb = float("nan")

    def on_train_start(self, trainer, pl_module) -> None:
        self.device = pl_module.device
        self.scaler = getattr(trainer.precision_plugin, "scaler", None)
        if self.scaler is not None:
            self.scales.append(self.scaler.get_scale())
        reset_peak_memory(self.device)
        sync(self.device)
        self.ends.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sync(self.device)
        self.ends.append(time.perf_counter())
        self.batches.append((batch["src_mask"], batch["tgt_out"]))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.loss = loss.detach()
        if self.scaler is not None:
            self.scales.append(self.scaler.get_scale())

    def on_train_end(self, trainer, pl_module) -> None:
        self.peak_mb = peak_memory_mb(self.device)
        self.model = pl_module.model
        self.steps = trainer.global_step
        self.skipped_nonfinite = pl_module.skipped_steps
        self.module_tgt_tokens_per_s = (pl_module.train_tgt_tokens / pl_module.train_seconds
                                        if pl_module.train_tgt_tokens and pl_module.train_seconds else None)

    def summary(self, peak: float | None) -> dict[str, Any]:
        batches = len(self.batches)
        warmup = min(self.warmup, batches - 2)
        if warmup < 0:
            raise RuntimeError(f"only {batches} training batches ran: nothing to time")
        seconds = self.ends[-1] - self.ends[warmup]
        lengths = Lengths()
        for src_mask, tgt_out in self.batches[warmup:]:
            lengths.add({"src_mask": src_mask, "tgt_out": tgt_out})
        flops = training_flops(self.model, lengths) / seconds
        loss = float(self.loss) if self.loss is not None else float("nan")
        out = {
            "steps": self.steps, "batches": batches, "timed_batches": batches - warmup, "timed_seconds": seconds,
            "tgt_tokens_per_s": lengths.tgt / seconds, "tokens_per_s": (lengths.src + lengths.tgt) / seconds,
            "batch_ms": 1000 * seconds / (batches - warmup), "flops_per_s": flops,
            "peak_fraction": flops / peak if peak else None, "peak_mb": self.peak_mb,
            "final_loss": loss, "loss_finite": math.isfinite(loss), "skipped_nonfinite_loss": self.skipped_nonfinite,
            "module_tgt_tokens_per_s": self.module_tgt_tokens_per_s,
        }
        if self.scales:  # 16-mixed: the scale halves at every step whose gradients overflowed (skipped)
            out["loss_scale"] = {"start": self.scales[0], "end": self.scales[-1],
                                 "skipped_steps": sum(b < a for a, b in zip(self.scales, self.scales[1:]))}
        return out

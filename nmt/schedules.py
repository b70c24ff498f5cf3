"""Learning-rate schedules, built by Hydra as partials that receive the optimizer."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau


def inverse_sqrt(optimizer: Optimizer, warmup_steps: int = 4000) -> LambdaLR:
    """Linear warmup to the optimizer's lr, then decay with 1/sqrt(step) (Vaswani et al. 2017,
    eq. 3, with the peak set by ``lr`` instead of ``d_model ** -0.5``)."""
    warmup_steps = max(1, warmup_steps)

    def factor(step: int) -> float:
        step += 1
        return min(step / warmup_steps, math.sqrt(warmup_steps / step))

    return LambdaLR(optimizer, factor)


def warmup_cosine(optimizer: Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> LambdaLR:
    """Linear warmup, then cosine decay to ``min_ratio * lr`` at ``total_steps`` (then flat)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def plateau(optimizer: Optimizer, factor: float = 0.5, patience: int = 2, min_lr: float = 1e-6) -> ReduceLROnPlateau:
    """Multiply the lr by ``factor`` when val/bleu stops improving (checked once per epoch)."""
    return ReduceLROnPlateau(optimizer, mode="max", factor=factor, patience=patience, min_lr=min_lr)

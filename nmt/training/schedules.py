"""Learning-rate schedules, built by Hydra as partials that receive the optimizer."""

from __future__ import annotations

import math
from typing import Any

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


class WarmupCosine(LambdaLR):
    """Linear warm-up to the optimizer's lr, then a cosine decay to ``min_ratio * lr`` at
    ``total_steps`` (then flat); ``factor(step)`` multiplies the peak rate. ``total_steps`` None or
    <= 0 (``trainer.max_steps=-1``; ``from_budget``): the decay ends where the run's budget does,
    ``max_time`` at the pace so far or the last step of ``max_epochs``, which
    ``nmt.training.callbacks.ScheduleHorizon`` sets and re-estimates as training goes; until it is first
    set, the factor stays at 1 after the warm-up."""

    SHAPE = ("warmup_steps", "total_steps", "min_ratio", "from_budget")

    def __init__(self, optimizer: Optimizer, warmup_steps: int, total_steps: int | None = None,
                 min_ratio: float = 0.0) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps if total_steps is not None and total_steps > 0 else None
        self.min_ratio = min_ratio
        self.from_budget = self.total_steps is None
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / max(1, self.warmup_steps)
        if self.total_steps is None:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def state_dict(self) -> dict[str, Any]:
        """The step and rates, not the shape: a resumed run decays to its own config's end (or
        re-estimated budget), not the saved one's."""
        return {key: value for key, value in super().state_dict().items() if key not in self.SHAPE}


def plateau(optimizer: Optimizer, factor: float = 0.5, patience: int = 2, min_lr: float = 1e-6) -> ReduceLROnPlateau:
    """Multiply the lr by ``factor`` when val/bleu stops improving (checked once per epoch)."""
    return ReduceLROnPlateau(optimizer, mode="max", factor=factor, patience=patience, min_lr=min_lr)

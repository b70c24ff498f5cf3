"""Callbacks the tests add to training runs, in process or on a command line
(``+callbacks.<name>._target_=tests.callbacks.<Class>``)."""

from __future__ import annotations

import torch
from pytorch_lightning import Callback


class PoisonAt(Callback):
    """Makes one weight of the output layer NaN at the end of training step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                module.model.decoder.out.weight[0, 0] = float("nan")

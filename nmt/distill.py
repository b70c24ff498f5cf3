"""Sequence-level knowledge distillation in one command: ``nmt-distill distill.teacher=<ckpt>
data=<its corpus> model=<student>`` (``nmt/conf/distill.yaml``: ``train.yaml`` plus ``distill``).

The teacher translates the training sources (``nmt.training.distillation``: beam search, the
CTranslate2 backend where the teacher can use it, batched, resumable, with progress and the time
left); the student then trains on those translations exactly as ``train.py`` trains, with every
``train.py`` option, and is validated and tested on the corpus's own references. Its run config
names the distilled folder as its data, so ``nmt-evaluate`` scores it on those references too.
"""

from __future__ import annotations

import math

import hydra
from omegaconf import DictConfig

from nmt import CONF_DIR, register_resolvers
from nmt.cli_io import ending_cleanly


def main() -> None:
    """``nmt-distill``, ``python distill.py``: the config resolvers, then Hydra composes and runs ``run``."""
    register_resolvers()
    run()


@hydra.main(config_path=CONF_DIR, config_name="distill", version_base="1.3")
def run(cfg: DictConfig) -> float | None:
    from nmt.train import set_up_process, train
    from nmt.training.distillation import distil, student_data

    set_up_process(cfg)
    with ending_cleanly():  # a teacher that is not a model, a bad key: one line, status 1

        student_data(cfg, distil(cfg))
        metrics = train(cfg)
    value = metrics.get(cfg.get("optimized_metric") or "")
    return None if value is None or math.isnan(value) else value


if __name__ == "__main__":
    main()

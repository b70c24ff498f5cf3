"""Sequence-level knowledge distillation in one command: ``nmt-distill distill.teacher=<ckpt>
data=<its corpus> model=<student>`` (``nmt/conf/distill.yaml``: ``train.yaml`` plus ``distill``).

The teacher translates the training sources (``nmt.training.distillation``: beam search, the
CTranslate2 backend where the teacher can use it, batched, resumable, with progress and the time
left); the student then trains on those translations exactly as ``train.py`` trains, with every
``train.py`` option, and is validated and tested on the corpus's own references. Its run config
names the distilled folder as its data, so ``nmt-evaluate`` scores it on those references too.

With ``distill.compare=true`` (the default) the run ends with ``nmt-evaluate``'s side-by-side
table in ``<run>/comparison/``: the teacher (when it is a checkpoint), the student and
``distill.compare_with`` (e.g. the same student trained on the references), on the test split's
references, with paired significance against the teacher.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import hydra
from hydra import compose
from omegaconf import DictConfig, open_dict

from nmt import CONF_DIR, register_resolvers
from nmt.cli_io import ending_cleanly
from nmt.runs.files import SUMMARY

log = logging.getLogger(__name__)


def main() -> None:
    """``nmt-distill``, ``python distill.py``: the config resolvers, then Hydra composes and runs ``run``."""
    register_resolvers()
    run()


@hydra.main(config_path=CONF_DIR, config_name="distill", version_base="1.3")
def run(cfg: DictConfig) -> float | None:
    from nmt.train import set_up_process, train
    from nmt.training.distillation import distil, student_data

    set_up_process(cfg)
    with ending_cleanly():  # a teacher that is not a model, a bad key: one line, status 2

        student_data(cfg, distil(cfg))
        metrics = train(cfg)
        if cfg.distill.get("compare", True) and cfg.get("test", True):
            compare(cfg)
    value = metrics.get(cfg.get("optimized_metric") or "")
    return None if value is None or math.isnan(value) else value


def compare(cfg: DictConfig) -> Path:
    """``nmt-evaluate`` of the teacher, the tested student and ``distill.compare_with`` on the
    test split, into ``<run>/comparison/``; returns its table."""
    from nmt.evaluate import evaluate
    from nmt.inference.ctranslate2 import is_export
    from nmt.training.distillation import teacher_files

    run_dir = Path(cfg.paths.output_dir)
    student = json.loads((run_dir / SUMMARY).read_text())["tested_checkpoint"]["path"]
    # the student first: evaluate reads the test split from its data config (the distilled folder's references)
    systems = {"student": f"'{student}'"}
    teachers = teacher_files(cfg)
    if not is_export(teachers[0]):  # an ensemble teacher is one system too
        quoted = [f"'{t}'" for t in teachers]
        systems["teacher"] = f"[{', '.join(quoted)}]" if len(teachers) > 1 else quoted[0]
    for name, path in (cfg.distill.get("compare_with") or {}).items():
        systems[str(name)] = f"'{path}'"
    out = run_dir / "comparison"
    names = ", ".join(f"{name}: {path}" for name, path in systems.items())
    baseline = ["baseline=teacher"] if "teacher" in systems else []
    evaluation = compose("evaluate", overrides=[f"ckpts={{{names}}}", *baseline, f"paths.cache_dir={cfg.paths.cache_dir}",
                                                "word_frequency=false", "reordering=false"])
    with open_dict(evaluation):
        evaluation.paths.output_dir = str(out)
    out.mkdir(parents=True, exist_ok=True)
    evaluate(evaluation)
    log.info("the teacher and the students side by side: %s", out / "comparison.md")
    return out / "comparison.md"


if __name__ == "__main__":
    main()

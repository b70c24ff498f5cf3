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
from pathlib import Path

from hydra import compose
from omegaconf import DictConfig, open_dict

from nmt.cli_io import hydra_command, stop_within_grace
from nmt.runs.files import SUMMARY

log = logging.getLogger(__name__)


def set_up(cfg: DictConfig) -> None:
    """A training run's process-wide settings (``nmt.train.set_up_process``)."""
    from nmt.train import set_up_process

    set_up_process(cfg)


def run_distillation(cfg: DictConfig) -> float | None:
    """The teacher's translations of the training sources, the student trained on them, then
    compared with the teacher; the metric a sweeper optimizes."""
    from nmt.train import optimized_value, train
    from nmt.training.distillation import distil, student_data

    student_data(cfg, distil(cfg, loading=stop_within_grace))  # a signal stops the teacher's load within the grace
    metrics = train(cfg)
    if cfg.distill.get("compare", True) and cfg.get("test", True):
        compare(cfg)
    return optimized_value(cfg, metrics)


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
    # a teacher that reads both languages is given the corpus's, as it was for the translations (the others ignore them)
    languages = [f"src_lang={cfg.data.src_lang}", f"tgt_lang={cfg.data.tgt_lang}"] if reads_languages(
        teachers, bool(cfg.get("allow_pickle", False))) else []
    evaluation = compose("evaluate", overrides=[f"ckpts={{{names}}}", *baseline, *languages,
                                                f"paths.cache_dir={cfg.paths.cache_dir}", "word_frequency=false",
                                                "reordering=false"])
    with open_dict(evaluation):
        evaluation.paths.output_dir = str(out)
    out.mkdir(parents=True, exist_ok=True)
    evaluate(evaluation)
    log.info("the teacher and the students side by side: %s", out / "comparison.md")
    return out / "comparison.md"


def reads_languages(teachers: list, allow_pickle: bool = False) -> bool:
    """Whether the (first) teacher file reads the source language and writes the target's first (its
    run config's ``languages``); a CTranslate2 folder is not compared."""
    from nmt.checkpoints.files import read_checkpoint
    from nmt.inference.ctranslate2 import is_export

    if is_export(teachers[0]):
        return False
    languages = read_checkpoint(teachers[0], allow_pickle).get("run_config", {}).get("languages")
    return isinstance(languages, dict) and languages.get("target") == "decoder_prefix"


main = hydra_command("distill", run_distillation, set_up)  # nmt-distill, python distill.py: nmt/conf/distill.yaml

if __name__ == "__main__":
    main()

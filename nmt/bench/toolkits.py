"""Another toolkit trained beside ours on the same data, for ``scripts/compare_opennmt.py`` and
``scripts/compare_eole.py``: the pieces of our SentencePiece model it reads as its tokens, its YAML
configs, the training speed its log reports, and ours from ``train.py``'s ``summary.json``."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from nmt import CONF_DIR
from nmt.bench import checkout

REPORT = re.compile(r"Step (\d+)/.*?(\d+)/\s*(\d+) tok/s")


def write_pieces(data: str, work: Path, splits: tuple[str, ...] = ("train", "valid"),
                 raw: tuple[str, ...] = ()) -> dict[str, Path]:
    """Train (or load from the cache) this project's tokenizer for ``data`` and write each of
    ``splits`` as space-separated pieces (``{split}.{src,tgt}``), which OpenNMT-py and Eole read as
    their tokens; the splits in ``raw`` also as text (``{split}.raw.{src,tgt}``). ``paths["spm"]``:
    the SentencePiece model, to join pieces back into text."""
    from nmt.training.builders import build_datamodule

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"data={data}"], return_hydra_config=True)
    with open_dict(cfg):  # what @hydra.main would set
        cfg.hydra.runtime.output_dir, cfg.hydra.runtime.cwd, cfg.hydra.job.num = str(work), str(checkout()), 0
    HydraConfig().set_config(cfg)
    dm = build_datamodule(cfg.data)
    dm.setup()
    paths = {"spm": Path(dm.tgt_vocab.model_file)}
    for split in splits:
        src, tgt = dm.raw(split)
        for side, lines, vocab in (("src", src, dm.src_vocab), ("tgt", tgt, dm.tgt_vocab)):
            path = work / f"{split}.{side}"
            path.write_text("".join(" ".join(vocab.pieces(ids)) + "\n" for ids in vocab.encode_batch(lines)), encoding="utf-8")
            paths[f"{split}_{side}"] = path
            if split in raw:
                paths[f"{split}_raw_{side}"] = work / f"{split}.raw.{side}"
                paths[f"{split}_raw_{side}"].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return paths


def yaml_lines(config: dict) -> str:
    """``config`` as YAML, nested dicts indented and every other value as JSON."""
    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out.append(f"{key}:")
            out += [f"  {line}" for line in yaml_lines(value).splitlines()]
        elif isinstance(value, float) and "e" in repr(value) and "." not in repr(value):
            out.append(f"{key}: {repr(value).replace('e', '.0e')}")  # YAML 1.1 reads 1e-09 as a string
        else:
            out.append(f"{key}: {json.dumps(value)}")
    return "\n".join(out) + "\n"


def vocab_config(work: Path, paths: dict[str, Path]) -> Path:
    """The config from which OpenNMT-py's ``onmt_build_vocab`` and Eole's ``build_vocab`` count the
    training pieces into ``work/vocab`` (one piece<TAB>count file, shared by source and target)."""
    path = work / "vocab.yaml"
    path.write_text(yaml_lines({"src_vocab": str(work / "vocab"), "share_vocab": True, "overwrite": True, "n_sample": -1,
                                "save_data": str(work), "data": {"corpus_1": {"path_src": str(paths["train_src"]),
                                                                               "path_tgt": str(paths["train_tgt"])}}}))
    return path


def report_speed(log: str, warmup: int) -> float | None:
    """Target tokens/s of the report lines (``Step N/...; ... src/tgt tok/s``, OpenNMT-py's and
    Eole's) after ``warmup`` steps, weighted by time; None without such a line."""
    rates = [int(tgt) for step, _, tgt in REPORT.findall(log) if int(step) > warmup]
    return statistics.harmonic_mean(rates) if rates else None  # tokens over time, for windows of similar tokens


def our_speed(model: str, steps: int, precision: str, data: str, out: Path, threads: int) -> float:
    """Target tokens/s of ``train.py`` with the comparisons' settings, trained into ``out``: its
    ``summary.json`` (the first step excluded)."""
    command = [sys.executable, str(checkout() / "train.py"), f"model={model}", f"data={data}", "data.max_tokens=3000",
               f"trainer.max_steps={steps}", f"trainer.precision={precision}", "test=false", "scheduler=inverse_sqrt",
               "trainer.num_sanity_val_steps=0", "trainer.val_check_interval=1000000", "trainer.check_val_every_n_epoch=null",
               "trainer.max_time=null", "callbacks.rich_progress_bar=null", "trainer.enable_progress_bar=false",
               f"hydra.run.dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    run = subprocess.run(command, cwd=checkout(), env=env, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"{' '.join(command[1:])} failed:\n{run.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())["train_tgt_tokens_per_sec"]

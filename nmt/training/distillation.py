"""Sequence-level knowledge distillation (Kim and Rush 2016): the teacher translates the training
sources, and a student trains on its translations (``nmt-distill``, ``nmt/distill.py``).

``distil(cfg)`` writes, once per teacher, corpus and decoding settings, the folder
``<cache_dir>/distilled/<key>/`` in ``FileSource``'s layout (``<split>.<lang>``): the training
sources with the teacher's translations (optionally only those it scores at least
``distill.min_score``), and the validation and test pairs as they are, so the student is
validated and tested on the original references. The training sources are translated
``distill.chunk_lines`` at a time in the corpus order, each chunk saved as it is done
(``<key>.partial/``, a file renamed into place): a run interrupted at any point resumes at its
first unsaved chunk, and the folder is renamed into place when complete. The progress is logged
with the sentences per second and the time left.

The teacher is a checkpoint, a release file or a CTranslate2 folder. ``distill.backend=auto``
translates a Transformer checkpoint through CTranslate2 when ``ctranslate2`` is installed (the
export is kept in the partial folder), else with the torch backend.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from nmt.data.prepare import streaming
from nmt.data.sources import SPLITS, DataError, _file_stamp
from nmt.inference.backends import open_translator
from nmt.inference.ctranslate2 import is_export

log = logging.getLogger(__name__)

FORMAT = 1  # of the distilled folder
BACKENDS = ("auto", "torch", "ctranslate2")


def _teacher_stamp(teacher: Path) -> list[Any]:
    """What says the teacher changed, without reading it (a CTranslate2 folder: its model.bin)."""
    if not teacher.exists():
        raise FileNotFoundError(f"distill.teacher={teacher}: no such file or folder")
    return _file_stamp(teacher / "model.bin" if teacher.is_dir() else teacher)


def teacher_files(cfg: DictConfig) -> list[Path]:
    """The teacher's files: ``distill.teacher``, one checkpoint, release file or CTranslate2 folder,
    or a list of checkpoint or release files decoding as one ensemble (``nmt.models.ensemble``)."""
    value = cfg.distill.teacher
    files = list(value) if isinstance(value, (ListConfig, list, tuple)) else [value]
    if not files or not all(isinstance(f, (str, Path)) for f in files):
        raise ValueError(f"distill.teacher={value}: a checkpoint, release file or CTranslate2 folder, or a list of "
                         "checkpoint or release files (an ensemble)")
    return [Path(str(f)).expanduser().resolve() for f in files]


def _translator_config(cfg: DictConfig, ckpt: Path | list[Path], backend: str) -> DictConfig:
    d = cfg.distill
    return OmegaConf.create({
        "ckpt": [str(c) for c in ckpt] if isinstance(ckpt, list) else str(ckpt), "backend": backend, "device": d.device, "precision": d.precision, "kernels": "auto",
        "allow_pickle": bool(cfg.get("allow_pickle", False)), "decoding": OmegaConf.to_container(d.decoding),
        "max_tokens": int(d.max_tokens), "workers": d.workers,
        "ctranslate2": {"compute_type": "default", "intra_threads": 1}})


def _open_teacher(cfg: DictConfig, work: Path) -> Any:
    """The teacher's translator: a CTranslate2 folder as it is; a checkpoint through CTranslate2
    (exported into ``work``) where ``backend`` allows it and the model exports, else torch; an
    ensemble on torch."""
    teachers, backend = teacher_files(cfg), str(cfg.distill.backend)
    if backend not in BACKENDS:
        raise ValueError(f"distill.backend={backend}: choose one of {', '.join(BACKENDS)}")
    if len(teachers) > 1:
        if backend == "ctranslate2":
            raise ValueError("distill.backend=ctranslate2: an ensemble teacher translates with the torch backend "
                             "(distill.backend=auto or torch)")
        return open_translator(_translator_config(cfg, teachers, "torch"))
    teacher = teachers[0]
    if is_export(teacher) or backend == "torch":
        return open_translator(_translator_config(cfg, teacher, backend if backend != "auto" else "auto"))
    converted = work / "teacher_ct2"
    if not is_export(converted):
        try:
            from nmt.checkpoints.loading import load_checkpoint
            from nmt.exporters.ctranslate2 import to_ctranslate2
        except ModuleNotFoundError as e:
            if e.name != "ctranslate2" or backend == "ctranslate2":
                raise
            log.info("distill: ctranslate2 is not installed; the teacher translates with the torch backend")
            return open_translator(_translator_config(cfg, teacher, "torch"))
        loaded = load_checkpoint(teacher, allow_pickle=bool(cfg.get("allow_pickle", False)))
        try:
            shutil.rmtree(converted, ignore_errors=True)
            to_ctranslate2(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, converted)
        except ValueError as e:  # not a Transformer CTranslate2 expresses
            if backend == "ctranslate2":
                raise
            log.info("distill: the teacher translates with the torch backend (%s)", e)
            return open_translator(_translator_config(cfg, teacher, "torch"))
        log.info("distill: the teacher converted to CTranslate2 in %s", converted)
    return open_translator(_translator_config(cfg, converted, "ctranslate2"))


def _languages(translator: Any, cfg: DictConfig) -> dict[str, str]:
    """What each ``translate`` call names: a teacher that reads the source language and writes the
    target's first (an imported M2M100, NLLB-200 or mBART-50, or a run fine-tuned from one) is
    given the corpus's, ``data.src_lang`` and ``data.tgt_lang`` in its own codes (``deu_Latn``),
    and its translator refuses a code it does not know; any other must translate that pair."""
    info = translator.info() if hasattr(translator, "info") else {}
    wanted = (str(cfg.data.src_lang), str(cfg.data.tgt_lang))
    if info.get("reads_src_lang"):
        return {"src_lang": wanted[0], "tgt_lang": wanted[1]}
    pair = (info.get("src_lang"), info.get("tgt_lang"))
    if None not in pair and pair != wanted:
        raise ValueError(f"distill.teacher={cfg.distill.teacher} translates {pair[0]}->{pair[1]}, but data is "
                         f"{wanted[0]}->{wanted[1]}: give the teacher of this corpus (or data= its corpus)")
    return {}


def _chunks(source: Any, size: int) -> Iterator[tuple[list[str], list[str]]]:
    """The training pairs with both sides non-empty (as preparation keeps them), ``size`` at a time."""
    src: list[str] = []
    tgt: list[str] = []
    for batch in source.pairs("train"):
        for s, t in zip(batch[0], batch[1]):
            s, t = s.strip(), t.strip()
            if s and t:
                src.append(s)
                tgt.append(t)
                if len(src) == size:
                    yield src, tgt
                    src, tgt = [], []
    if src:
        yield src, tgt


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def distil(cfg: DictConfig, loading: Callable[[], AbstractContextManager[Any]] = nullcontext) -> Path:
    """The distilled corpus folder of ``cfg`` (see the module docstring), written first when absent.
    The teacher loads inside ``loading()`` (``nmt-distill``: ``nmt.cli_io.stop_within_grace``, so a
    signal stops the load within the grace)."""
    from hydra.utils import instantiate

    d = cfg.distill
    if d.min_score is not None and (isinstance(d.min_score, bool) or not isinstance(d.min_score, (int, float))):
        raise ValueError(f"distill.min_score={d.min_score!r}: a number (the teacher's length-normalised "
                         "log-probability, e.g. -1.5) or null")
    chunk_lines = int(d.chunk_lines)
    if chunk_lines < 1:
        raise ValueError(f"distill.chunk_lines={chunk_lines}: a positive number of sentences")
    source = streaming(instantiate(cfg.data.source))
    src_lang, tgt_lang = str(cfg.data.src_lang), str(cfg.data.tgt_lang)
    teachers = teacher_files(cfg)
    stamps = [_teacher_stamp(t) for t in teachers]
    key = {"format": FORMAT, "source": source.describe(), "teacher": stamps[0] if len(stamps) == 1 else stamps,
           "decoding": OmegaConf.to_container(d.decoding, resolve=True), "backend": str(d.backend),
           "chunk_lines": chunk_lines}
    name = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    root = Path(str(d.cache_dir)) / "distilled"
    folder, work = root / name, root / f"{name}.partial"
    if (folder / "manifest.json").is_file():
        log.info("distill: the teacher's translations are in %s", folder)
        return _filtered(folder, d.min_score, src_lang, tgt_lang)
    work.mkdir(parents=True, exist_ok=True)
    _write_atomic(work / "key.json", json.dumps(key, indent=1) + "\n")
    with loading():
        translator = _open_teacher(cfg, work)
    languages = _languages(translator, cfg)
    total = sum(len(s) for s, _ in _chunks(source, chunk_lines))  # reading is cheap beside translating
    done, start, translated_now = 0, time.perf_counter(), 0
    for i, (src, _) in enumerate(_chunks(source, chunk_lines)):
        part = work / f"train.{i:06d}.jsonl"
        if not part.is_file():
            rows = [{"src": s, "hyp": t.text, "score": t.hypotheses[0].score if t.hypotheses else None}
                    for s, t in zip(src, translator.translate(src, **languages))]
            _write_atomic(part, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            translated_now += len(src)
        done += len(src)
        rate = translated_now / max(time.perf_counter() - start, 1e-9)
        left = (total - done) / rate if translated_now else 0.0
        log.info("distill: %d of %d training sentences translated (%.1f%%), %.1f sentences/s, %s left",
                 done, total, 100 * done / total, rate, _clock(left))
    with open(work / f"train.{src_lang}.tmp", "w", encoding="utf-8") as fs, \
            open(work / f"train.{tgt_lang}.tmp", "w", encoding="utf-8") as ft, \
            open(work / "train.score.tmp", "w", encoding="utf-8") as fc:
        for part in sorted(work.glob("train.*.jsonl")):
            # JSON lines end in LF alone: splitlines() would also cut at U+2028, U+2029 or U+0085 inside a sentence
            for line in part.read_text(encoding="utf-8").split("\n")[:-1]:
                row = json.loads(line)
                fs.write(row["src"] + "\n")
                ft.write(row["hyp"] + "\n")
                fc.write(json.dumps(row["score"]) + "\n")
    for split in SPLITS[1:]:  # valid and test as they are: the student is scored on the references
        with open(work / f"{split}.{src_lang}", "w", encoding="utf-8") as fs, \
                open(work / f"{split}.{tgt_lang}", "w", encoding="utf-8") as ft:
            for batch in source.pairs(split):
                for s, t in zip(batch[0], batch[1]):
                    fs.write(s.strip() + "\n")
                    ft.write(t.strip() + "\n")
    for suffix in (src_lang, tgt_lang, "score"):
        os.replace(work / f"train.{suffix}.tmp", work / f"train.{suffix}")
    for part in work.glob("train.*.jsonl"):
        part.unlink()
    shutil.rmtree(work / "teacher_ct2", ignore_errors=True)
    manifest = {"format": FORMAT, "key": key, "pairs": total, "teacher": [str(t) for t in teachers] if len(teachers) > 1 else str(teachers[0]),
                "translator": type(translator).__name__, "seconds": round(time.perf_counter() - start, 1)}
    _write_atomic(work / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    work.rename(folder)
    log.info("distill: %d training sentences translated by the teacher into %s", total, folder)
    return _filtered(folder, d.min_score, src_lang, tgt_lang)


def _filtered(folder: Path, min_score: float | None, src_lang: str, tgt_lang: str) -> Path:
    """``folder``, or with ``min_score`` its copy ``<folder>/min_score=<x>/`` holding the training
    pairs the teacher scored at least ``min_score`` (valid and test linked as they are)."""
    if min_score is None:
        return folder
    out = folder / f"min_score={float(min_score):g}"
    if (out / "kept.json").is_file():
        return out
    tmp = folder / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    kept = read = 0
    with open(folder / f"train.{src_lang}", encoding="utf-8") as fs, open(folder / f"train.{tgt_lang}", encoding="utf-8") as ft, \
            open(folder / "train.score", encoding="utf-8") as fc, open(tmp / f"train.{src_lang}", "w", encoding="utf-8") as os_, \
            open(tmp / f"train.{tgt_lang}", "w", encoding="utf-8") as ot:
        for s, t, c in zip(fs, ft, fc):
            read += 1
            score = json.loads(c)
            if score is not None and score >= min_score:
                os_.write(s)
                ot.write(t)
                kept += 1
    if not kept:
        shutil.rmtree(tmp)
        raise DataError(f"distill.min_score={min_score}: the teacher scored every one of its {read} translations "
                        "lower; lower it or set it to null")
    for split in SPLITS[1:]:
        for lang in (src_lang, tgt_lang):
            os.link(folder / f"{split}.{lang}", tmp / f"{split}.{lang}")
    (tmp / "kept.json").write_text(json.dumps({"min_score": min_score, "read": read, "kept": kept}) + "\n")
    tmp.rename(out)
    log.info("distill: kept %d of %d training pairs the teacher scored at least %g", kept, read, min_score)
    return out


def student_data(cfg: DictConfig, folder: Path) -> None:
    """Point ``cfg.data`` at the distilled folder (the rest of the data config, tokenizer and
    batching, stays the user's)."""
    OmegaConf.set_struct(cfg, False)
    cfg.data.source = {"_target_": "nmt.data.sources.FileSource", "path": str(folder),
                       "src_lang": str(cfg.data.src_lang), "tgt_lang": str(cfg.data.tgt_lang)}
    OmegaConf.set_struct(cfg, True)

"""nmt.training.distillation and nmt-distill: the distilled corpus holds the teacher's own
translations of the training sources (and the references of valid and test), an interrupted run
resumes where it stopped with the same result, min_score keeps what the teacher scored at least,
and bad teachers are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict

from nmt.checkpoints.files import CheckpointError
from nmt.data.sources import DataError
from nmt.inference.translator import Translator
from nmt.text_lines import read_lines
from nmt.training import distillation
from nmt.training.distillation import distil
from tests.conftest import CONF_DIR, ROOT

TINY = ROOT / "tests" / "data" / "tiny"
TEACHER = ROOT / "tests" / "data" / "saved" / "transformer.ckpt"  # a tiny Transformer, src -> tgt


def config(tmp_path: Path, *overrides: str) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("distill", overrides=[f"distill.teacher={TEACHER}", "data=files", f"data.source.path={TINY}",
                                            "data.src_lang=src", "data.tgt_lang=tgt", "model=transformer",
                                            f"paths.cache_dir={tmp_path / 'cache'}", f"paths.log_dir={tmp_path}",
                                            "distill.backend=torch", "distill.precision=32", "distill.workers=1",
                                            "distill.chunk_lines=30", *overrides], return_hydra_config=True)
    GlobalHydra.instance().clear()
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def test_the_corpus_is_the_teachers_translations_and_the_references(tmp_path):
    cfg = config(tmp_path)
    folder = distil(cfg)
    sources = read_lines(TINY / "train.src", strip=True)
    teacher = Translator.load(str(TEACHER), precision="32", workers=1, decoding=dict(cfg.distill.decoding))
    assert read_lines(folder / "train.src") == sources
    assert read_lines(folder / "train.tgt") == [t.text for t in teacher.translate(sources)]
    for split in ("valid", "test"):
        for side in ("src", "tgt"):
            assert read_lines(folder / f"{split}.{side}") == read_lines(TINY / f"{split}.{side}", strip=True)
    assert json.loads((folder / "manifest.json").read_text())["pairs"] == len(sources) == 100
    assert distil(cfg) == folder and not list(folder.parent.glob("*.partial"))  # found again, not redone


def test_an_interrupted_run_resumes_at_its_first_unsaved_chunk(tmp_path, monkeypatch):
    """Stopped in its third chunk (of four), the run keeps the two saved chunks; the next run
    translates the last two only and writes what an uninterrupted run writes."""
    whole = distil(config(tmp_path / "whole"))
    calls: list[int] = []
    translate = Translator.translate

    def stopping(self, lines, *args, **kwargs):
        if len(lines) > 1:  # a chunk (loading may translate one line to time the precision)
            calls.append(len(lines))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return translate(self, lines, *args, **kwargs)

    monkeypatch.setattr(Translator, "translate", stopping)
    cfg = config(tmp_path / "parts")
    with pytest.raises(KeyboardInterrupt):
        distil(cfg)
    partial = next((tmp_path / "parts" / "cache" / "distilled").glob("*.partial"))
    assert sorted(p.name for p in partial.glob("train.*.jsonl")) == ["train.000000.jsonl", "train.000001.jsonl"]
    calls.clear()
    folder = distil(cfg)
    assert calls == [30, 10]
    for name in ("train.src", "train.tgt", "train.score"):
        assert (folder / name).read_bytes() == (whole / name).read_bytes()


def test_min_score_keeps_the_pairs_the_teacher_scored_at_least_it(tmp_path):
    folder = distil(config(tmp_path))
    scores = [json.loads(line) for line in read_lines(folder / "train.score")]
    threshold = sorted(scores)[len(scores) // 2]
    kept = distil(config(tmp_path, f"distill.min_score={threshold}"))
    expected = [(s, t) for s, t, c in zip(read_lines(folder / "train.src"), read_lines(folder / "train.tgt"), scores)
                if c >= threshold]
    assert list(zip(read_lines(kept / "train.src"), read_lines(kept / "train.tgt"))) == expected
    assert 0 < len(expected) < len(scores) and read_lines(kept / "test.tgt") == read_lines(folder / "test.tgt")
    with pytest.raises(DataError, match=r"^distill.min_score=0.0: the teacher scored every one of its 100 "
                                        r"translations lower; lower it or set it to null$"):
        distil(config(tmp_path, "distill.min_score=0.0"))


def test_an_ensemble_teacher_of_one_model_twice_writes_that_models_corpus(tmp_path):
    """``distill.teacher=[a,a]`` translates with the ensemble (torch), as ``a`` alone; an ensemble
    on the CTranslate2 backend is refused in one line."""
    alone = distil(config(tmp_path / "alone"))
    twice = distil(config(tmp_path / "twice", f"distill.teacher=[{TEACHER},{TEACHER}]"))
    assert read_lines(twice / "train.tgt") == read_lines(alone / "train.tgt")
    assert json.loads((twice / "manifest.json").read_text())["teacher"] == [str(TEACHER), str(TEACHER)]
    with pytest.raises(ValueError, match=r"^distill.backend=ctranslate2: an ensemble teacher translates with the torch "
                                         r"backend \(distill.backend=auto or torch\)$"):
        distil(config(tmp_path / "ct2", f"distill.teacher=[{TEACHER},{TEACHER}]", "distill.backend=ctranslate2"))


def test_bad_teachers_are_refused_in_one_line(tmp_path):
    not_a_model = tmp_path / "notes.ckpt"
    not_a_model.write_text("not a model\n")
    with pytest.raises(CheckpointError, match=str(not_a_model)) as refused:
        distil(config(tmp_path, f"distill.teacher={not_a_model}"))
    assert "\n" not in str(refused.value)
    with pytest.raises(FileNotFoundError, match=r"^distill.teacher=/nonexistent.ckpt: no such file or folder$"):
        distil(config(tmp_path, "distill.teacher=/nonexistent.ckpt"))
    with pytest.raises(ValueError, match=r"^distill.teacher=.*transformer.ckpt translates src->tgt, but data is "
                                         r"tgt->src: give the teacher of this corpus \(or data= its corpus\)$"):
        distil(config(tmp_path, "data.src_lang=tgt", "data.tgt_lang=src"))
    with pytest.raises(ValueError, match=r"^distill.backend=fast: choose one of auto, torch, ctranslate2$"):
        distil(config(tmp_path, "distill.backend=fast"))
    assert not list((tmp_path / "cache" / "distilled").glob("*/manifest.json"))


def test_the_ctranslate2_teacher_gives_the_torch_teachers_corpus(tmp_path):
    """backend=auto converts the Transformer teacher to CTranslate2 (kept only while translating)."""
    pytest.importorskip("ctranslate2")
    torch_folder = distil(config(tmp_path / "torch"))
    ct2_folder = distil(config(tmp_path / "ct2", "distill.backend=auto"))
    assert json.loads((ct2_folder / "manifest.json").read_text())["translator"] == "CTranslate2Translator"
    ours, theirs = read_lines(torch_folder / "train.tgt"), read_lines(ct2_folder / "train.tgt")
    # a barely trained teacher: its outputs run to the length cap, where the two backends' rounding differs
    assert sum(a == b for a, b in zip(ours, theirs)) >= 0.9 * len(ours)
    assert not (ct2_folder / "teacher_ct2").exists()


@pytest.mark.slow  # a student trained end to end
def test_nmt_distill_trains_a_student_on_the_teachers_translations(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(ROOT / "distill.py"), f"distill.teacher={TEACHER}", "data=files", f"data.source.path={TINY}",
         "data.src_lang=src", "data.tgt_lang=tgt", "model=transformer", "model.hidden_size=32", "trainer.max_steps=30",
         f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}", "distill.workers=1",
         f"distill.compare_with={{other: '{TEACHER}'}}", "distill.chunk_lines=40"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    from nmt.checkpoints.files import read_checkpoint

    folder = next((tmp_path / "cache" / "distilled").glob("*/manifest.json")).parent
    student = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert student["run_config"]["data"]["source"]["path"] == str(folder)  # nmt-evaluate reads its references there
    assert (tmp_path / "run" / "bleu_by_length.md").is_file() and "distill: 100 of 100 training sentences" in result.stdout + result.stderr
    assert read_lines(folder / "test.tgt") == read_lines(TINY / "test.tgt", strip=True)
    table = (tmp_path / "run" / "comparison" / "comparison.md").read_text()  # side by side, against the teacher
    assert all(f" {name} BLEU [95% CI] |" in table for name in ("student", "teacher", "other")), table
    assert "| student vs teacher | all |" in table and "| other vs teacher | all |" in table, table


def test_the_distilled_folder_layout_is_what_file_source_reads(tmp_path):
    from nmt.data.sources import FileSource

    folder = distil(config(tmp_path))
    source = FileSource(str(folder), "src", "tgt")
    source.describe()
    assert [p for chunk in source.pairs("train") for p in zip(chunk[0], chunk[1])] == list(
        zip(read_lines(folder / "train.src"), read_lines(folder / "train.tgt")))
    assert distillation.FORMAT == json.loads((folder / "manifest.json").read_text())["format"]


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_training_sentences_holding_unicode_line_separators_are_distilled(tmp_path, separator):
    """The teacher's rows are JSON lines written with ensure_ascii=False: read back with
    splitlines(), a sentence holding U+2028, U+2029 or U+0085 broke its row in two
    (JSONDecodeError after the whole teacher pass). train.py reads such a corpus as it is."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("train.src", "train.tgt", "valid.src", "valid.tgt", "test.src", "test.tgt"):
        lines = (TINY / name).read_text(encoding="utf-8").splitlines()
        if name == "train.src":
            lines[3] = lines[3].replace(" ", f" {separator} ", 1)
        (corpus / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    folder = distil(config(tmp_path, f"data.source.path={corpus}"))
    sources = read_lines(folder / "train.src")
    assert len(sources) == 100 and separator in sources[3] and len(read_lines(folder / "train.tgt")) == 100



@pytest.mark.slow  # an M2M100 folder built, imported and translating the corpus
def test_a_teacher_reading_both_languages_is_given_the_corpus_codes(tmp_path):
    """An imported M2M100 teacher (the source code a tag, the target code its first output token)
    translates each training source with ``data.src_lang`` and ``data.tgt_lang``, the corpus's
    codes in its own code system: the corpus holds what ``translate(src_lang=, tgt_lang=)`` gives
    (and the comparison after the test gives it those codes too); a code the teacher does not know
    is refused in one line."""
    pytest.importorskip("transformers")
    import nmt.distill as distillation_compare
    from nmt.checkpoints.files import atomic_save
    from nmt.checkpoints.m2m100 import import_folder
    from tests.test_m2m100 import m2m100_folder

    teacher = tmp_path / "m2m100.ckpt"
    atomic_save(import_folder(m2m100_folder(tmp_path / "hf")), teacher)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "valid", "test"):
        for side, langs in (("src", ("de",)), ("tgt", ("fr", "xx"))):
            for lang in langs:
                (corpus / f"{split}.{lang}").write_text((TINY / f"{split}.{side}").read_text())
    common = [f"distill.teacher={teacher}", f"data.source.path={corpus}", "data.src_lang=de"]
    cfg = config(tmp_path, *common, "data.tgt_lang=fr")
    folder = distil(cfg)
    sources = read_lines(corpus / "train.de", strip=True)
    translator = Translator.load(str(teacher), precision="32", workers=1, decoding=dict(cfg.distill.decoding))
    expected = [t.text for t in translator.translate(sources, src_lang="de", tgt_lang="fr")]
    assert read_lines(folder / "train.fr") == expected
    assert expected != [t.text for t in translator.translate(sources, src_lang="de", tgt_lang="zu")]  # the code counts
    assert distillation_compare.reads_languages([teacher]) and not distillation_compare.reads_languages([TEACHER])
    with pytest.raises(ValueError, match=r"^tgt_lang=xx: unknown language code") as refused:
        distil(config(tmp_path / "xx", *common, "data.tgt_lang=xx"))
    assert "\n" not in str(refused.value)

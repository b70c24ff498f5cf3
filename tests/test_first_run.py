"""What a new user sees: a run whose output is a file logs its progress as lines instead of a
bar, prints three test sentences with their translations and the command that translates the
test sources, records the test interval, and keeps one file where the best checkpoint is the
final state; the bar's epoch reads right; a translation of text the model cannot read warns once."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nmt.checkpoints.files import saved_vocabularies
from nmt.inference.translator import Translator
from nmt.inference.unknown_input import unknown_pieces, unknown_share
from nmt.training.callbacks import RunProgressBar
from nmt.training.progress_lines import ProgressLines

SAVED = Path(__file__).parent / "data" / "saved" / "transformer.ckpt"


def test_a_run_writing_to_a_file_logs_progress_lines_examples_and_keeps_one_copy(cfg_train, caplog, capsys):
    from nmt.train import train

    cfg = cfg_train(["test=true", "trainer.max_epochs=2", "callbacks.progress_lines.every_n_steps=2",
                     "callbacks.progress_lines.when=always", "+callbacks.bar={_target_: nmt.training.callbacks.RunProgressBar}"])
    with caplog.at_level(logging.INFO):
        train(cfg)
    out = Path(cfg.paths.output_dir)
    text = caplog.text
    # progress as lines, the bar left out (the configured one, and Lightning's own)
    assert "progress as a log line every 2 steps (callbacks.progress_lines) instead of the progress bar" in text
    lines = [r.getMessage() for r in caplog.records if r.name == "nmt.training.progress_lines"]
    assert lines and all(line.startswith("step ") for line in lines)
    assert "loss " in lines[-1] and "(nll " in lines[-1] and "tokens/s" in lines[-1] and " left" in lines[-1]
    assert "Epoch" not in capsys.readouterr().out  # no bar drew, and no Lightning test table either
    # the summary: three test sentences and their translations, and a command for all of them
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("run finished"))
    sources = (out / "test_sources.txt").read_text().splitlines()
    hyps = (out / "test_hyps.txt").read_text().splitlines()
    shown = [i for i, line in enumerate(sources) if f"  {line}\n  -> {hyps[i]}" in summary]
    assert len(shown) == 3
    assert f"< {out / 'test_sources.txt'} > translations.txt" in summary
    assert "transformer BLEU" not in summary and "lstm_bahdanau BLEU [95% CI]" in summary  # as bleu_by_length.md
    assert "lstm_bahdanau BLEU [95% CI]" in (out / "bleu_by_length.md").read_text()
    record = json.loads((out / "summary.json").read_text())
    report = json.loads((out / "bleu_by_length.json").read_text())
    assert record["test"] == {"bleu": round(report["bleu"], 2), "bleu_ci": [round(v, 2) for v in report["bleu_ci"]],
                              "chrf": round(report["chrf"], 2), "sentences": report["count"]}
    assert record["metrics"]["train/nll"] < record["metrics"]["train/loss"]  # label smoothing adds to the loss
    # the best checkpoint and last.ckpt: one file where the best is the final state, else two
    files = sorted(p.name for p in (out / "checkpoints").glob("*.ckpt"))
    best = Path(record["best_checkpoint"])
    assert len(files) == 2 and best.is_file()
    last = out / "checkpoints" / "last.ckpt"
    final_is_best = torch.load(best, weights_only=True, mmap=True)["global_step"] == record["steps"]
    assert os.path.samefile(best, last) == final_is_best
    if final_is_best:
        assert "is now a second name of last.ckpt (one copy on disk)" in text


def test_the_best_and_the_last_checkpoint_share_a_file_only_when_equal(tmp_path):
    from nmt.training.callbacks import LastCheckpoint, share_best_with_last

    last = LastCheckpoint(str(tmp_path))
    best = tmp_path / "best.ckpt"
    state = torch.load(SAVED, weights_only=True)
    torch.save(state, best)
    torch.save(state, last.path)
    assert not share_best_with_last(best, last)  # no step saved by this callback: nothing to share
    last.step = state["global_step"]
    changed = {**state, "state_dict": {k: v + 1 if v.is_floating_point() else v for k, v in state["state_dict"].items()}}
    torch.save(changed, last.path)
    assert not share_best_with_last(best, last) and not os.path.samefile(best, last.path)
    torch.save(state, last.path)
    assert share_best_with_last(best, last) and os.path.samefile(best, last.path)
    assert not list(tmp_path.glob("*.link"))


def test_the_bar_shows_the_epoch_alone_without_an_epoch_limit():
    bar = RunProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)
    assert bar._get_train_description(2).strip() == "Epoch 2"
    bar._trainer = SimpleNamespace(max_epochs=10)
    assert bar._get_train_description(2).strip() == "Epoch 2/9"


@pytest.mark.parametrize("kwargs, message", [
    ({"when": "sometimes"}, "callbacks.progress_lines.when='sometimes': choose one of auto, always, never"),
    ({"every_n_steps": 0}, "callbacks.progress_lines.every_n_steps=0: a whole number of optimizer steps, at least 1"),
    ({"every_n_steps": 2.5}, "callbacks.progress_lines.every_n_steps=2.5: a whole number of optimizer steps, at least 1"),
])
def test_progress_lines_refuse_bad_settings(kwargs, message):
    with pytest.raises(ValueError) as e:
        ProgressLines(**kwargs)
    assert str(e.value) == message


def test_progress_lines_are_off_on_a_terminal(monkeypatch):
    monkeypatch.setattr("nmt.training.progress_lines.output_is_terminal", lambda: True)
    assert not ProgressLines().active and ProgressLines(when="always").active
    monkeypatch.setattr("nmt.training.progress_lines.output_is_terminal", lambda: False)
    assert ProgressLines().active and not ProgressLines(when="never").active


def test_unknown_pieces_count_unk_and_words_spelled_letter_by_letter():
    src, _ = saved_vocabularies(SAVED)
    own = (Path(__file__).parent / "data" / "tiny" / "test.src").read_text().splitlines()[:20]
    unknown, total = unknown_share(src, [src.encode(line) for line in own])
    assert total > 0 and unknown / total < 0.1  # the model's own language
    english = src.encode("The weather is lovely and bright today.")
    assert unknown_pieces(src, english) / len(english) > 0.5
    chinese = src.encode("我们明天去北京")  # no such characters in the vocabulary: <unk>
    assert unknown_pieces(src, chinese) == len(chinese)
    # a word of a script without spaces is not "spelled out" for being split into characters
    assert unknown_pieces(src, [i for i in src.encode("nu") if not src.sp.is_unknown(i)]) == 0


def test_a_translation_of_text_the_model_cannot_read_warns_once(caplog):
    translator = Translator.load(SAVED, device="cpu", precision="32")
    own = (Path(__file__).parent / "data" / "tiny" / "test.src").read_text().splitlines()[:2]
    with caplog.at_level(logging.WARNING, logger="nmt.inference.translator"):
        translator.translate(own)
        assert "unknown to this model's source vocabulary" not in caplog.text
        translator.translate(["Good morning, how are you doing today?", "The weather is lovely."])
        translator.translate(["The weather is lovely."])
    warnings = [r.getMessage() for r in caplog.records if "unknown to this model's source vocabulary" in r.getMessage()]
    assert len(warnings) == 1
    assert "of input lines 1-2 (" in warnings[0] and "(data.src_lang=src)" in warnings[0]


def test_the_final_weights_compete_for_best_on_the_same_validation_sample(cfg_train):
    """A budget that is not a multiple of the validation interval: the final weights are
    validated on the same sample as the others (step 5 after 2 and 4), and summary.json shows
    the choice."""
    from nmt.train import train

    cfg = cfg_train(["test=false", "trainer.max_epochs=-1", "trainer.max_steps=5", "trainer.val_check_interval=2",
                     "trainer.check_val_every_n_epoch=null", "data.val_sample=4"])
    train(cfg)
    record = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    validation = record["validation"]
    assert [(r["step"], r["sentences"]) for r in validation["runs"]] == [(2, 4), (4, 4), (5, 4), (5, validation["sentences"])]
    chosen = validation["best_chosen"]
    assert chosen["steps"] == [2, 4, 5] and chosen["final"]["step"] == 5 and chosen["sentences"] == 4
    scores = {r["step"]: r["bleu"] for r in validation["runs"][:3]}
    assert chosen["best"] == {"step": max(scores, key=scores.get), "bleu": max(scores.values())}
    best_step = torch.load(record["best_checkpoint"], weights_only=True, mmap=True)["global_step"]
    assert best_step == chosen["best"]["step"]

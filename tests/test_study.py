"""nmt-study without training: the collection of finished runs into the study table and
comparison, the second stage's overrides, and one-line refusals of bad input. The whole study
(training included) runs in tests/test_length_report.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from nmt.evaluation.length_report import length_report
from nmt.study import second_stage

SOURCES = ["a b", "a b c d e f g h i j k l", "a " * 25]
REFS = ["x y z w", "x y z w v", "x y z w v u"]


def fake_run(folder: Path, model: str, hyps: list[str]) -> None:
    """A finished run folder of the multirun: its summary and its test report."""
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({
        "overrides": ["experiment=bleu_vs_length", f"model={model}"], "parameters": 2_500_000,
        "train_tokens_per_sec": 1234.4, "fit_seconds": 120.0, "train_wall_seconds": 90.0, "steps": 40}))
    report = length_report(SOURCES, hyps, REFS, edges=[10, 20], n_bootstrap=10)
    (folder / "bleu_by_length.json").write_text(json.dumps(report))


def nmt_study(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nmt.study", *args], capture_output=True, text=True, timeout=300)


def test_collect_tabulates_finished_runs_and_compares_them(tmp_path):
    fake_run(tmp_path / "lstm", "lstm", ["x", "x", "x"])
    fake_run(tmp_path / "lstm_bahdanau", "lstm_bahdanau", REFS)
    result = nmt_study("--collect", str(tmp_path), "--heatmaps", "0")
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert lines[0] == ("| model | parameters | train tokens/s | train minutes | steps | test BLEU | BLEU 1-10 | BLEU >20 |")
    assert lines[2].startswith("| lstm | 2.5M | 1,234 | 1.5 | 40 | ")
    assert lines[3] == "| lstm_bahdanau | 2.5M | 1,234 | 1.5 | 40 | 100.0 | 100.0 | 100.0 |"
    assert set(json.loads((tmp_path / "comparison" / "comparison.json").read_text())) == {"lstm", "lstm_bahdanau"}
    assert (tmp_path / "comparison" / "comparison.png").is_file()


def test_the_second_stage_resumes_each_model_with_its_overrides_in_place_of_the_first():
    first = Path("/runs/study")
    assert second_stage(["trainer.max_steps=5", "seed=2"], ["trainer.max_steps=9"], first) == [
        "seed=2", "ckpt_path=/runs/study/${hydra:runtime.choices.model}/checkpoints/last.ckpt",
        "data.vocab_from=${ckpt_path}", "trainer.max_steps=9"]
    assert second_stage([], ["ckpt_path=/elsewhere.ckpt"], first) == ["data.vocab_from=${ckpt_path}", "ckpt_path=/elsewhere.ckpt"]


def test_bad_input_is_refused_in_one_line(tmp_path):
    assert nmt_study("--help").stdout.startswith("usage: nmt-study")
    cases = {
        ("--models", "lstm,lstm_typo"): "nmt-study: no model preset 'lstm_typo' (nmt/conf/model/lstm_typo.yaml)",
        ("--experiment", "nope"): "nmt-study: no experiment preset 'nope' (nmt/conf/experiment/nope.yaml)",
        ("--collect", str(tmp_path / "missing")): f"nmt-study: --collect {tmp_path / 'missing'}: no such folder",
        ("--collect", str(tmp_path)): f"nmt-study: no finished runs (summary.json) under {tmp_path}",
        ("--collect", str(tmp_path), "--then", "seed=2"): "nmt-study: --then trains a second stage; --collect only collects: give one of them",
        ("--heatmap", "2"): "nmt-study: unknown option --heatmap (overrides are key=value; --help lists the options)",
    }
    for args, message in cases.items():
        result = nmt_study(*args)
        assert (result.returncode, result.stderr.strip()) == (1, message), args

"""Word accuracy by training frequency (nmt.evaluation.word_frequency): bands, counts and F-measure on
hand-built sentences, the paired test, and evaluate's comparison report."""

from __future__ import annotations

import json

import pytest

from nmt.evaluation import word_frequency as wf
from tests.conftest import ROOT, evaluate_here


def test_default_bands_are_compare_mts():
    assert wf.labels() == ["unseen", "1", "2", "3", "4", "5-9", "10-99", "100-999", ">=1000"]
    assert wf.labels((2, 10)) == ["<2", "2-9", ">=10"]


def test_counts_precision_recall_and_f_per_band_on_hand_built_sentences():
    frequency = wf.counts(["the cat sat on the mat .", "the dog ."] * 600)
    assert (frequency["the"], frequency["."], frequency["cat"], frequency["sat"]) == (1800, 1200, 600, 600)
    frequency = {**frequency, "cat": 3, "dog": 1}
    hyps = ["the cat sat .", "a dog dog ."]
    refs = ["the dog sat .", "the dog ."]
    per = wf.sentence_counts(hyps, refs, frequency)
    unseen, one, three, many = 0, 1, 3, 8
    assert per[0, three].tolist() == [0, 1, 0]          # cat: output only
    assert per[0, one].tolist() == [1, 0, 0]            # dog: reference only
    assert per[1, one].tolist() == [1, 2, 1]            # dog twice against once: one match (clipped)
    assert per[1, unseen].tolist() == [0, 1, 0]         # "a" never occurs in training
    assert per[0, many].tolist() == [2, 2, 2] and per[1, many].tolist() == [2, 1, 1]  # the, .
    assert per[0, 7].tolist() == [1, 1, 1]  # sat: 600, the 100-999 band
    bands = {b["band"]: b for b in wf.bands(hyps, refs, frequency, n_bootstrap=200)}
    assert (bands["1"]["precision"], bands["1"]["recall"]) == (50.0, 50.0) and bands["1"]["f"] == pytest.approx(50.0)
    assert bands["3"]["f"] == 0.0 and bands["unseen"]["ref_words"] == 0 and bands["2"]["f"] == 0.0
    assert bands[">=1000"]["f"] == pytest.approx(200 * 3 / 7)
    for band in bands.values():
        assert band["f_ci_low"] <= band["f"] + 1e-9 and band["f"] <= band["f_ci_high"] + 1e-9


def test_the_paired_test_finds_no_difference_against_itself_and_one_where_rare_words_are_lost():
    frequency = {"the": 5000, "a": 5000, "zebra": 1, "okapi": 2}
    refs = [f"the {w} a" for w in ("zebra", "okapi") * 20]
    lost = ["the a" for _ in refs]
    same = wf.paired(refs, refs, refs, frequency, n_bootstrap=200)
    assert all(r["delta_f"] == 0.0 and r["p"] == 1.0 for r in same)
    rows = {r["band"]: r for r in wf.paired(refs, lost, refs, frequency, n_bootstrap=200)}
    assert rows["1"]["delta_f"] == 100.0 and rows["1"]["p"] < 0.01 and rows[">=1000"]["delta_f"] == 0.0
    with pytest.raises(ValueError, match="2 hypotheses for 3 references"):
        wf.sentence_counts(["a", "b"], ["a", "b", "c"], frequency)


def test_evaluate_reports_word_f_by_training_frequency_and_tests_it(tmp_path, capsys):
    refs = (ROOT / "tests/data/tiny/test.tgt").read_text().splitlines()
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("\n".join(refs) + "\n")
    bad.write_text("\n".join(" ".join(r.split()[::2]) for r in refs) + "\n")
    out = tmp_path / "eval"
    result = evaluate_here(capsys, out, "data=tiny", f"hyps={{good: {good}, bad: {bad}}}", "n_bootstrap=50",
                           "significance.bootstrap=50", "significance.randomization=50", f"paths.cache_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "comparison.json").read_text())
    assert all(b["f"] == 100.0 for b in report["good"]["frequency"] if b["ref_words"])
    assert sum(b["ref_words"] for b in report["good"]["frequency"]) == sum(len(wf.words(r)) for r in refs)
    assert any(b["f"] < 100.0 for b in report["bad"]["frequency"] if b["ref_words"])
    assert report["bad"]["frequency_vs_baseline"]["baseline"] == "good" and "frequency_vs_baseline" not in report["good"]
    md = (out / "comparison.md").read_text()
    assert "| training frequency | reference words | good word F [95% CI] | bad word F [95% CI] |" in md
    assert "| bad vs good | >=1000 |" in md or "| bad vs good | 10-99 |" in md
    off = evaluate_here(capsys, tmp_path / "off", "data=tiny", f"hyps={{good: {good}}}", "n_bootstrap=10",
                        "word_frequency=false", f"paths.cache_dir={tmp_path}")
    assert off.returncode == 0 and "frequency" not in json.loads((tmp_path / "off" / "comparison.json").read_text())["good"]

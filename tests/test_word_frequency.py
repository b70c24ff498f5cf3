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
    assert bands["3"]["f"] == 0.0 and bands["unseen"]["ref_words"] == 0
    assert bands[">=1000"]["f"] == pytest.approx(200 * 3 / 7)
    for band in bands.values():
        if band["f"] is not None:
            assert band["f_ci_low"] <= band["f"] + 1e-9 and band["f"] <= band["f_ci_high"] + 1e-9


def test_a_band_without_words_is_empty_not_zero():
    """No word of the references or outputs occurs twice in training: the band "2" has nothing to
    score, so its F, precision, recall and interval are None (JSON null) and its cell reads empty,
    in the paired test too; a band with words but no match stays 0."""
    frequency = {"the": 5000, "cat": 1, "dog": 3}
    hyps, refs = ["the cat"] * 4, ["the dog"] * 4
    bands = {b["band"]: b for b in wf.bands(hyps, refs, frequency, n_bootstrap=50)}
    empty = bands["2"]
    assert (empty["ref_words"], empty["hyp_words"]) == (0, 0)
    assert [empty[k] for k in ("f", "f_ci_low", "f_ci_high", "precision", "recall")] == [None] * 5
    assert json.loads(json.dumps(empty))["f"] is None
    assert bands["1"]["f"] == 0.0 and bands["1"]["recall"] is None and bands["3"]["precision"] is None
    rows = {r["band"]: r for r in wf.paired(hyps, refs, refs, frequency, n_bootstrap=50)}
    assert rows["2"]["delta_f"] is None and "p" not in rows["2"] and rows["3"]["delta_f"] == -100.0
    md = wf.markdown({"sys": {"frequency": list(bands.values()),
                              "frequency_vs_baseline": {"baseline": "ref", "rows": list(rows.values())}}})
    assert "| 2 | 0 | empty |" in md and "| sys vs ref | 2 | empty | |" in md
    assert "| 3 | 4 | 0.0 [0.0, 0.0] |" in md  # words, no match: F 0, as it is


def test_chinese_words_are_its_characters_not_its_clauses():
    """Chinese is scored in sacreBLEU's zh tokens (one per character), the tokenizer nmt.languages.writing
    picks for it: a reference of five characters has five words, the one unseen in training among
    them; 13a would count the whole clause as one unseen word."""
    from nmt.languages.writing import bleu_tokenizer

    tokenize = bleu_tokenizer("zh")
    assert tokenize == "zh"
    training = ["我喜欢猫。", "他喜欢我。"] * 3
    frequency = wf.counts(training, tokenize)
    assert frequency["喜"] == 6 and frequency["猫"] == 3 and "我喜欢猫。" not in frequency
    refs, hyps = ["我喜欢狗。"], ["我喜欢猫。"]
    bands = {b["band"]: b for b in wf.bands(hyps, refs, frequency, n_bootstrap=0, tokenize=tokenize)}
    assert sum(b["ref_words"] for b in bands.values()) == 5 and bands["unseen"]["ref_words"] == 1  # 狗
    assert bands["5-9"]["matches"] == 4 and bands["unseen"]["hyp_words"] == 0
    whole = {b["band"]: b for b in wf.bands(hyps, refs, wf.counts(training), n_bootstrap=0)}  # 13a: clauses
    assert whole["unseen"]["ref_words"] == 1 and sum(b["ref_words"] for b in whole.values()) == 1


def test_evaluates_frequency_analysis_counts_in_the_target_languages_tokens():
    """analyses.by_frequency scores the words of the split's tokenizer (Scored.tokenize), as the
    training counts are read (training_counts(datamodule, tokenize))."""
    from omegaconf import OmegaConf

    from nmt.evaluation.analyses import Scored, by_frequency

    refs, hyps = ["我喜欢狗。", "他喜欢猫。"], {"sys": ["我喜欢猫。", "他喜欢猫。"]}
    test = Scored(["a", "b"], ["a", "b"], refs, "words", hyps, "sys", (10,), "zh")
    reports = {"sys": {}}
    by_frequency(OmegaConf.create({"n_bootstrap": 0, "significance": {"bootstrap": 0}}), test,
                 wf.counts(["我喜欢猫。"] * 2, "zh"), reports)
    assert sum(b["ref_words"] for b in reports["sys"]["frequency"]) == 10


def test_the_paired_test_finds_no_difference_against_itself_and_one_where_rare_words_are_lost():
    frequency = {"the": 5000, "a": 5000, "zebra": 1, "okapi": 2}
    refs = [f"the {w} a" for w in ("zebra", "okapi") * 20]
    lost = ["the a" for _ in refs]
    same = wf.paired(refs, refs, refs, frequency, n_bootstrap=200)
    assert all(r["delta_f"] == 0.0 and r["p"] == 1.0 for r in same if r["band"] in ("1", "2", ">=1000"))
    assert all(r["delta_f"] is None for r in same if r["band"] not in ("1", "2", ">=1000"))  # no words
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

"""Paired tests against a baseline: identical, clearly better, tiny buckets, seeds, the evaluate CLI."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest
from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

from nmt.evaluation.length_report import bleu_from_stats, sentence_stats
from nmt.evaluation.significance import sacrebleu_seed, significance
from tests.conftest import ROOT, evaluate_here
from tests.test_length_report import corpus

FAST = {"bootstrap": 100, "randomization": 200}


def tiny():
    """Test split of tests/data/tiny: references, and references cut to their first half."""
    sources = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()
    refs = (ROOT / "tests/data/tiny/test.tgt").read_text().splitlines()
    return sources, refs, [" ".join(r.split()[: len(r.split()) // 2]) for r in refs]


def test_sentence_stats_sum_to_sacrebleu_corpus_statistics():
    sources, hyps, refs = corpus()
    for bleu in (BLEU(), BLEU(tokenize="char")):
        total = sentence_stats(bleu, hyps, refs).sum(0)
        direct = bleu.corpus_score(hyps, [refs])
        assert list(total) == [direct.sys_len, direct.ref_len, *direct.counts, *direct.totals]
        assert bleu_from_stats(bleu, total) == direct.score


def test_identical_system_gets_delta_zero_and_p_one():
    sources, hyps, refs = corpus()
    result = significance({"base": hyps, "copy": list(hyps)}, sources, refs, "base", [10, 20, 30], **FAST)
    assert set(result) == {"copy"}
    for row in result["copy"]["rows"]:
        if row["count"]:
            assert row["delta"] == 0.0 and row["delta_ci_low"] == row["delta_ci_high"] == 0.0
            assert row["p_bootstrap"] == row["p_randomization"] == 1.0
    # why it is not left to sacreBLEU: a difference never larger than 0 counts as significant there
    _, scores = PairedTest([("base", hyps), ("copy", hyps)], {"BLEU": BLEU()}, [refs], test_type="ar", n_samples=200)()
    assert scores["BLEU"][1].p_value == pytest.approx(1 / 201)


def test_clearly_better_system_is_significant_with_an_interval_above_zero():
    sources, refs, cut = tiny()
    result = significance({"cut": cut, "full": refs}, sources, refs, "cut", [5, 10], min_sentences=3, **FAST)
    rows = {row["bucket"]: row for row in result["full"]["rows"]}
    assert list(rows) == ["1-5", "6-10", ">10", "all"]
    overall = rows["all"]
    assert overall["count"] == overall["differing"] == 20
    assert overall["delta"] == pytest.approx(100.0 - BLEU().corpus_score(cut, [refs]).score)
    assert 0 < overall["delta_ci_low"] <= overall["delta"] <= overall["delta_ci_high"]
    assert overall["p_bootstrap"] < 0.05 and overall["p_randomization"] < 0.05
    for row in rows.values():  # every bucket of the tiny split has sentences, so every row is scored
        assert row["count"] > 0 and row["delta"] > 0 and row["p_bootstrap"] is not None


def test_tiny_and_empty_buckets_do_not_crash():
    sources, refs, cut = tiny()
    # edges [3, 4, 100]: buckets of 3 and 2 sentences, one of 15, and an empty one
    default = significance({"cut": cut, "full": refs}, sources, refs, "cut", [3, 4, 100], **FAST)["full"]["rows"]
    assert [r["count"] for r in default] == [3, 2, 15, 0, 20]
    assert default[0]["differing"] == 3 and default[0]["delta"] == 0.0  # 3-word sentences: no 4-grams, BLEU 0 both
    assert default[1]["delta"] > 0 and default[1]["delta_ci_low"] is None and default[1]["p_bootstrap"] is None
    assert default[3]["delta"] is None and default[3]["p_randomization"] is None  # empty: nothing, not 0
    forced = significance({"cut": cut, "full": refs}, sources, refs, "cut", [1, 2, 3, 4, 100], min_sentences=1,
                          **FAST)["full"]["rows"]
    assert [r["count"] for r in forced][:2] == [0, 0]
    for row in forced:
        if row["count"]:
            assert 0 < row["p_bootstrap"] <= 1 and 0 < row["p_randomization"] <= 1
            assert row["delta_ci_low"] <= row["delta_ci_high"]


def test_same_seed_same_results_and_no_leaked_environment(monkeypatch):
    sources, hyps, refs = corpus()
    _, other, _ = corpus(seed=1)  # same references and sources, other hypotheses
    noisy = [o if i % 4 == 0 else h for i, (h, o) in enumerate(zip(hyps, other))]
    run = lambda seed: significance({"a": hyps, "b": noisy}, sources, refs, "a", [20], seed=seed, **FAST)  # noqa: E731
    monkeypatch.delenv("SACREBLEU_SEED", raising=False)
    first = run(7)
    assert "SACREBLEU_SEED" not in os.environ
    monkeypatch.setenv("SACREBLEU_SEED", "99")
    assert run(7) == first and os.environ["SACREBLEU_SEED"] == "99"
    assert run(8)["b"]["rows"] != first["b"]["rows"]
    with pytest.raises(ValueError, match="unseeded"), sacrebleu_seed(0):
        pass


def test_delta_interval_shares_the_bootstrap_tests_resamples():
    """The interval's resampled corpora are the ones sacreBLEU's paired bootstrap draws: the
    system's mean BLEU over them equals PairedTest's."""
    sources, hyps, refs = corpus()
    _, other, _ = corpus(seed=1)
    bleu = BLEU()
    with sacrebleu_seed(5):
        test = PairedTest([("a", hyps), ("b", other)], {"BLEU": bleu}, [refs], test_type="bs", n_samples=50)
    _, scores = test()
    stats = sentence_stats(bleu, other, refs)
    idx = np.random.default_rng(5).choice(len(refs), size=(50, len(refs)), replace=True)
    assert np.mean([bleu_from_stats(bleu, stats[i].sum(0)) for i in idx]) == pytest.approx(scores["BLEU"][1].mean)


def test_unknown_baseline_is_an_error():
    sources, hyps, refs = corpus(n=10)
    with pytest.raises(ValueError, match="baseline 'nope'"):
        significance({"a": hyps, "b": hyps}, sources, refs, "nope", [10], **FAST)


def test_evaluate_writes_the_significance_table(tmp_path, capsys):
    sources, refs, cut = tiny()
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("\n".join(refs) + "\n")
    bad.write_text("\n".join(cut) + "\n")
    out = tmp_path / "eval"
    result = evaluate_here(capsys, out, "data=tiny", f"hyps={{good: {good}, bad: {bad}}}", "baseline=bad",
                           "length_buckets=[5,10]", "n_bootstrap=20", "significance.bootstrap=100",
                           "significance.randomization=200", "significance.min_sentences=3",
                           f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr
    table = (out / "comparison.md").read_text()
    assert "| system vs baseline | bucket | sentences | differing | delta BLEU [95% CI] | p bootstrap | p randomisation |" in table
    assert "| good vs bad | all | 20 | 20 |" in table and "sacreBLEU ar: `nrefs:1|ar:200|seed:12345" in table
    report = json.loads((out / "comparison.json").read_text())
    assert set(report) == {"good", "bad"} and "significance" not in report["bad"]
    assert [r["bucket"] for r in report["good"]["significance"]["rows"]] == ["1-5", "6-10", ">10", "all"]
    with (out / "comparison.csv").open() as f:
        rows = list(csv.DictReader(f))
    good_all = next(r for r in rows if r["system"] == "good" and r["bucket"] == "all")
    assert good_all["vs_baseline"] == "bad" and float(good_all["delta_bleu"]) > 0 and float(good_all["p_randomization"]) < 0.05
    assert all(r["vs_baseline"] == "" and r["p_bootstrap"] == "" for r in rows if r["system"] == "bad")

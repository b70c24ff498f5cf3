"""BLEU by source length: buckets, empty buckets, agreement with sacreBLEU, written files."""

from __future__ import annotations

import json
import random

import pytest
from sacrebleu.metrics import BLEU, CHRF

from nmt.evaluation.length_report import bucket_bounds, length_report, source_lengths, write_report


def corpus(n=120, seed=0):
    rng = random.Random(seed)
    words = "the a cat dog sat ran on under mat house big small red".split()
    sources, refs, hyps = [], [], []
    for _ in range(n):
        length = rng.randint(1, 45)
        ref = [rng.choice(words) for _ in range(length)]
        hyp = [w if rng.random() < 0.8 else rng.choice(words) for w in ref]
        sources.append(" ".join(rng.choice(words) for _ in range(length)))
        refs.append(" ".join(ref))
        hyps.append(" ".join(hyp))
    return sources, hyps, refs


def test_bucket_edges():
    assert bucket_bounds([10, 20, 30]) == [("1-10", 1, 10), ("11-20", 11, 20), ("21-30", 21, 30), (">30", 31, None)]
    with pytest.raises(ValueError, match="increasing positive edges"):
        bucket_bounds([10, 10])
    assert source_lengths(["a b  c", "你好 世界"], "words") == [3, 2]
    assert source_lengths(["你好 世界"], "chars") == [4]


def test_per_bucket_scores_equal_sacrebleu_on_the_subset():
    sources, hyps, refs = corpus()
    report = length_report(sources, hyps, refs, edges=[10, 20, 30], n_bootstrap=200)
    lengths = source_lengths(sources)
    assert sum(b["count"] for b in report["buckets"]) == len(hyps)
    for b in report["buckets"]:
        index = [i for i, n in enumerate(lengths) if n >= b["low"] and (b["high"] is None or n <= b["high"])]
        assert b["count"] == len(index)
        h, r = [hyps[i] for i in index], [refs[i] for i in index]
        direct = BLEU().corpus_score(h, [r])
        assert b["bleu"] == pytest.approx(direct.score)
        assert b["length_ratio"] == pytest.approx(direct.sys_len / direct.ref_len)
        assert b["chrf"] == pytest.approx(CHRF().corpus_score(h, [r]).score)
        assert b["bleu_ci_low"] <= b["bleu"] <= b["bleu_ci_high"]
    assert report["bleu"] == pytest.approx(BLEU().corpus_score(hyps, [refs]).score)
    assert report["bleu_signature"].startswith("nrefs:1|case:mixed")


def test_an_empty_bucket_is_empty_not_zero():
    sources, hyps, refs = corpus()
    report = length_report(sources, hyps, refs, edges=[10, 100, 200], n_bootstrap=10)
    empty = report["buckets"][2]
    assert empty["label"] == "101-200" and empty["count"] == 0
    assert empty["bleu"] is None and empty["chrf"] is None and empty["bleu_ci_low"] is None
    assert empty["length_ratio"] is None


def test_length_ratio_shows_outputs_stopped_early():
    """Hypotheses that drop the second half of every long sentence: ratio 1 on short sentences,
    about 0.5 on long ones."""
    short = ["a b c d"] * 5
    long = [" ".join(f"w{i}" for i in range(40))] * 5
    refs = short + long
    hyps = short + [" ".join(r.split()[:20]) for r in long]
    report = length_report(refs, hyps, refs, edges=[10], n_bootstrap=0)
    assert [b["length_ratio"] for b in report["buckets"]] == [1.0, 0.5]
    assert report["length_ratio"] == pytest.approx(120 / 220)


def test_files_are_written(tmp_path):
    sources, hyps, refs = corpus()
    report = length_report(sources, hyps, refs, edges=[10, 20, 60], n_bootstrap=50)
    paths = write_report(report, tmp_path, name="sys")
    assert sorted(p.suffix for p in paths.values()) == [".csv", ".json", ".md", ".png"]
    assert json.loads(paths["json"].read_text())["count"] == len(hyps)
    rows = paths["csv"].read_text().splitlines()
    assert rows[0] == "bucket,low,high,count,bleu,chrf,bleu_ci_low,bleu_ci_high,length_ratio" and rows[-1].startswith("all,")
    assert rows[3].startswith("21-60,21,60,") and rows[4].startswith(">60,61,,0,,")  # empty bucket: blank scores
    assert "| >60 | 0 | empty |" in paths["md"].read_text()
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_evaluate_compares_two_hypothesis_files(tmp_path, capsys):
    from tests.conftest import ROOT, evaluate_here

    refs = (ROOT / "tests/data/tiny/test.tgt").read_text().splitlines()
    good = tmp_path / "good.txt"
    good.write_text("\n".join(refs) + "\n")
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join(" ".join(r.split()[:2]) for r in refs) + "\n")
    out = tmp_path / "eval"
    result = evaluate_here(capsys, out, "data=tiny", f"hyps={{good: {good}, bad: {bad}}}", "length_buckets=[5,10]",
                           "n_bootstrap=50", f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "comparison.json").read_text())
    assert set(report) == {"good", "bad"}
    assert report["good"]["bleu"] == pytest.approx(100.0)
    assert report["bad"]["bleu"] < 50
    assert [b["count"] for b in report["good"]["buckets"]] == [b["count"] for b in report["bad"]["buckets"]]
    table = (out / "comparison.md").read_text()
    assert "good BLEU [95% CI]" in table and "bad BLEU [95% CI]" in table
    assert (out / "comparison.png").is_file() and (out / "good" / "bleu_by_length.csv").is_file()


def test_evaluate_scores_the_validation_split_when_asked(tmp_path, capsys):
    """split=valid: the references are the valid split's (settings are chosen there; the test is
    read once); the test's hypotheses do not fit them."""
    from tests.conftest import ROOT, evaluate_here

    refs = {split: (ROOT / f"tests/data/tiny/{split}.tgt").read_text().splitlines() for split in ("valid", "test")}
    assert refs["valid"] != refs["test"]
    hyps = tmp_path / "valid.txt"
    hyps.write_text("\n".join(refs["valid"]) + "\n")
    common = ["data=tiny", "n_bootstrap=10", "word_frequency=false", f"paths.cache_dir={tmp_path / 'cache'}"]
    result = evaluate_here(capsys, tmp_path / "v", *common, f"hyps={{v: {hyps}}}", "split=valid")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "v" / "comparison.json").read_text())["v"]["bleu"] == pytest.approx(100.0)
    hyps.write_text("\n".join(refs["valid"][:-1]) + "\n")
    result = evaluate_here(capsys, tmp_path / "t", *common, f"hyps={{v: {hyps}}}")
    assert result.stderr.strip().endswith(f"error: {hyps}: {len(refs['valid']) - 1} lines, but the test split has "
                                          f"{len(refs['test'])} references")
    result = evaluate_here(capsys, tmp_path / "x", *common, f"hyps={{v: {hyps}}}", "split=train")
    assert result.stderr.strip().endswith("error: split=train: choose one of test, valid (tune on valid, read test once)")


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_study_script_trains_every_model_and_draws_the_comparison(tmp_path):
    """nmt-study: one multirun, then the comparison, the summary (with cost
    columns) and attention heatmaps for attention models only; with --then, a second stage that
    goes on from each model's checkpoint on other training pairs, collected the same way."""
    from tests.test_scale import cli_overrides, run

    out = tmp_path / "study"
    run(["-m", "nmt.study", "--models", "lstm,lstm_bahdanau", "--heatmaps", "1", "--out", str(out),
         *cli_overrides(tmp_path), "model.hidden_size=32", "trainer.max_epochs=2",
         "--then", "trainer.max_epochs=3 data.train_pairs=40"])
    summary = (out / "summary.md").read_text()
    assert "| model | parameters | train tokens/s | train minutes | steps | test BLEU |" in summary
    assert "| lstm |" in summary and "| lstm_bahdanau |" in summary
    report = json.loads((out / "comparison" / "comparison.json").read_text())
    assert set(report) == {"lstm", "lstm_bahdanau"}
    assert (out / "comparison" / "comparison.png").is_file()
    assert len(list((out / "attention" / "lstm_bahdanau").glob("*.png"))) == 1
    assert not (out / "attention" / "lstm").exists()  # no attention, no heatmap
    assert (out / "lstm" / "summary.json").is_file()  # one run folder per model

    for model in ("lstm", "lstm_bahdanau"):  # stage 2: one more epoch on 40 of the pairs, same vocabulary
        first, second = (json.loads((d / model / "summary.json").read_text()) for d in (out, out / "stage2"))
        assert second["resumed_from"] == str(out / model / "checkpoints" / "last.ckpt")
        assert second["epochs"] == 3 and first["epochs"] == 2 and second["steps"] > first["steps"]
        assert "data.train_pairs=40" in second["overrides"] and "trainer.max_epochs=2" not in second["overrides"]
    assert set(json.loads((out / "stage2" / "comparison" / "comparison.json").read_text())) == {"lstm", "lstm_bahdanau"}
    assert (out / "stage2" / "summary.md").is_file()


def test_reports_are_strict_json_with_null_for_what_was_not_computed():
    """An interval not computed (n_bootstrap=0) or an empty bucket's score is null, not NaN, which
    strict JSON readers (browsers, jq, Go, Rust) refuse."""
    import json

    from nmt.runs.files import json_text

    text = json_text({"bleu": 1.5, "bleu_ci": [float("nan"), float("inf")], "buckets": [{"chrf": -float("inf"), "n": 3}]})
    assert json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON")) == \
        {"bleu": 1.5, "bleu_ci": [None, None], "buckets": [{"chrf": None, "n": 3}]}


def test_a_report_without_intervals_shows_none_in_its_table_and_plot(tmp_path):
    """n_bootstrap=0 computes no interval: the table shows the score alone (never "[nan, nan]"),
    also when read back from its JSON (nulls), and the plot draws no error bar."""
    import json

    from nmt.evaluation.length_report import markdown_table, plot_bleu_by_length, write_report

    sources, hyps, refs = corpus()
    report = length_report(sources, hyps, refs, edges=[10, 20, 60], n_bootstrap=0)
    paths = write_report(report, tmp_path, name="m")
    for shown in (report, json.loads(paths["json"].read_text())):
        table = markdown_table({"m": shown})
        assert "nan" not in table and "None" not in table
        assert f"| all | {report['count']} | {report['bleu']:.1f} |" in table
    with_ci = markdown_table({"m": length_report(sources, hyps, refs, edges=[10, 20, 60], n_bootstrap=20)})
    assert "| all | " in with_ci and "[" in with_ci.split("| all |")[1]
    assert plot_bleu_by_length({"m": json.loads(paths["json"].read_text())}, tmp_path / "again.png").is_file()

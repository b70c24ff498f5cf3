"""BLEU by reordering distance and attention entropy by length (nmt.evaluation.reordering), on hand-built
alignments and attention, and in evaluate's report (gold alignments of synthetic data, a model's
forced alignments elsewhere)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nmt.evaluation import reordering as ro
from nmt.evaluate import load_test_split
from tests.conftest import evaluate_here


def test_the_distance_is_how_far_aligned_words_move():
    assert ro.reordering_distance({(0, 0), (1, 1), (2, 2)}, 3, 3) == 0.0  # monotone
    assert ro.reordering_distance({(2, 0), (1, 1), (0, 2)}, 3, 3) == pytest.approx(4 / 3)  # reversed: 2 + 0 + 2
    assert ro.reordering_distance({(0, 0), (2, 1), (1, 2)}, 3, 3) == pytest.approx(2 / 3)  # one swap
    assert ro.reordering_distance({(0, 0), (1, 2)}, 2, 3) == 0.0  # a longer translation alone is no reordering
    assert ro.reordering_distance(set(), 3, 3) == 0.0 and ro.reordering_distance({(0, 0)}, 1, 0) == 0.0


def test_buckets_hold_every_sentence_once_with_zero_apart():
    assert ro.reordering_labels() == ["0", "0-0.25", "0.25-0.5", "0.5-0.75", "0.75-1", "1-1.5", ">1.5"]
    distances = [0.0, 0.1, 0.25, 0.3, 2.0, 1.2, 0.0]
    buckets = ro.reordering_buckets(distances)
    assert [b.tolist() for b in buckets] == [[0, 6], [1, 2], [3], [], [], [5], [4]]
    rows = ro.bleu_by_reordering(["a b c d"] * 7, ["a b c d"] * 6 + ["x y z w"], distances, n_bootstrap=20)
    assert [r["count"] for r in rows] == [2, 2, 1, 0, 0, 1, 1] and rows[3]["bleu"] is None
    assert rows[1]["bleu"] == pytest.approx(100.0) and rows[0]["bleu"] < 100 and rows[0]["mean_distance"] == 0.0
    with pytest.raises(ValueError, match="1 hypotheses, 1 references and 2 distances differ in number"):
        ro.bleu_by_reordering(["a"], ["a"], [0, 0])


def test_attention_entropy_is_zero_when_sharp_and_log_n_when_uniform():
    assert ro.sentence_entropy([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]) == pytest.approx(0.0, abs=1e-9)
    assert ro.sentence_entropy(np.full((4, 5), 0.2).tolist()) == pytest.approx(math.log(5))
    rows = ro.entropy_by_length(["a b", "a b c d e f g h i j k l"], [0.5, None], [10])
    assert rows == [{"bucket": "1-10", "count": 1, "entropy": 0.5}, {"bucket": ">10", "count": 0, "entropy": None}]


def test_chinese_reordering_counts_characters_not_clauses():
    """English to Chinese: forced alignments in characters (Scored.words from nmt.languages.writing) place
    the target's words; in whitespace words every link would point at the one clause."""
    from omegaconf import OmegaConf

    from nmt.evaluation.analyses import Scored, by_reordering, words_of

    assert words_of("zh", ["我喜欢猫。"]) == "chars" and words_of("en", ["I like cats ."]) == "words"
    assert words_of("xx", ["我喜欢猫。他喜欢狗。"]) == "chars"  # a code nmt.languages.writing does not list: judged from the text
    sources, refs = ["I like cats ."] * 3, ["我喜欢猫。"] * 3
    monotone = {(0, 0), (1, 1), (2, 3), (3, 4)}  # in characters: in order, 4 words onto 5 characters
    test = Scored(sources, sources, refs, "words", {"sys": refs}, "sys", (10,), "zh", ("words", "chars"))
    reports = {"sys": {}}
    by_reordering(OmegaConf.create({"n_bootstrap": 0, "significance": {}}), test,
                  ("sys's forced", [monotone] * 3, ("words", "chars")), reports)
    row = reports["sys"]["reordering"][1]
    assert (row["bucket"], row["count"], row["mean_distance"]) == ("0-0.25", 3, pytest.approx(0.125))
    assert reports["sys"]["reordering_units"] == ["words", "chars"]
    md = ro.markdown(reports, "sys's forced")
    assert "| reordering (words) |" in md
    assert ro.reordering_distance(monotone, 4, 1) == pytest.approx(3 / 2)  # the clause as one word: links look moved


SYNTHETIC = ["data=synthetic", "data.source.num_pairs=300", "data.source.valid_pairs=20", "data.source.test_pairs=60",
             "data.tokenizer.input_sentence_size=300"]


def test_evaluate_buckets_synthetic_data_by_its_gold_reordering(tmp_path, capsys):
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        data = compose("evaluate", overrides=[*SYNTHETIC, f"paths.cache_dir={tmp_path}", "paths.root_dir=."]).data
    _, refs, _ = load_test_split(data)
    good, cut = tmp_path / "good.txt", tmp_path / "cut.txt"
    good.write_text("\n".join(refs) + "\n")
    cut.write_text("\n".join(" ".join(r.split()[:4]) for r in refs) + "\n")
    out = tmp_path / "eval"
    result = evaluate_here(capsys, out, *SYNTHETIC, f"hyps={{good: {good}, cut: {cut}}}", "n_bootstrap=20",
                           "significance.bootstrap=20", "significance.randomization=20", f"paths.cache_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "comparison.json").read_text())
    rows = report["good"]["reordering"]
    assert report["good"]["reordering_alignments"] == "gold" and sum(r["count"] for r in rows) == 60
    cut_rows = report["cut"]["reordering"]
    assert [r["count"] for r in cut_rows] == [r["count"] for r in rows] and max(r["count"] for r in rows) < 60
    assert all(r["bleu"] >= c["bleu"] for r, c in zip(rows, cut_rows) if r["count"])
    assert sum(r["bleu"] == pytest.approx(100.0) for r in rows if r["count"]) >= 3  # references score 100 ...
    assert report["good"]["reordering"][0]["mean_distance"] in (0.0, None)  # ... in buckets with a 4-gram
    md = (out / "comparison.md").read_text()
    assert "BLEU by reordering distance (mean words an aligned word moves, gold alignments):" in md
    assert "| reordering (words) | sentences | mean | good BLEU [95% CI] | cut BLEU [95% CI] |" in md
    assert "attention_entropy" not in report["good"]  # hypothesis files carry no attention
    test = report["cut"]["reordering_vs_baseline"]
    assert test["baseline"] == "good" and [r["bucket"] for r in test["rows"]] == [*ro.reordering_labels(), "all"]
    assert [r["count"] for r in test["rows"][:-1]] == [r["count"] for r in rows] and test["rows"][-1]["delta"] < -50
    assert "By reordering distance: Paired tests against `good`" in md and "reordering_vs_baseline" not in report["good"]


def test_evaluate_reports_attention_entropy_and_forced_reordering_of_a_checkpoint(serve_ckpt, tmp_path, capsys):
    out = tmp_path / "eval"
    result = evaluate_here(capsys, out, f"ckpts={{tf: {serve_ckpt}}}", "decoding=greedy", "n_bootstrap=10",
                           "length_buckets=[5,10]")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "comparison.json").read_text())["tf"]
    assert report["reordering_alignments"] == "tf's forced" and sum(r["count"] for r in report["reordering"]) == 20
    entropy = report["attention_entropy"]
    assert [b["bucket"] for b in entropy] == ["1-5", "6-10", ">10"] and sum(b["count"] for b in entropy) == 20
    assert all(b["entropy"] is None or 0 <= b["entropy"] <= math.log(300) for b in entropy)
    md = (out / "comparison.md").read_text()
    assert "Attention entropy (nats per output piece) by source length:" in md and "| 1-5 |" in md
    off = evaluate_here(capsys, tmp_path / "off", f"ckpts={{tf: {serve_ckpt}}}", "decoding=greedy", "n_bootstrap=10",
                        "reordering=false", "word_frequency=false")
    assert off.returncode == 0
    plain = json.loads((tmp_path / "off" / "comparison.json").read_text())["tf"]
    assert not {"reordering", "attention_entropy", "frequency"} & set(plain)

"""COMET (nmt/evaluation/comet.py, comet_files.py, segment_scores.py) on a COMET-shaped checkpoint
of random weights built here (tests/comet_checkpoint.py): the batched scores equal a sentence-at-a-time
computation written from the paper and the checkpoint's tensors (and COMET's own package, where it is
installed), the by-length intervals and the paired test equal loops over their resamples, and a
folder nmt cannot read is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from nmt.evaluation import segment_scores
from nmt.evaluation.comet_files import CometRefused, load_comet
from nmt.evaluation.length_report import bucket_indices, length_report
from tests.conftest import ROOT, evaluate_here

pytest.importorskip("transformers")

SOURCES = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()
REFS = (ROOT / "tests/data/tiny/test.tgt").read_text().splitlines()
VARIANTS = {  # hparams.yaml settings: wmt22-comet-da's head, and the other computations a checkpoint may ask for
    "sparsemax": {},
    "softmax_layer_norm": {"layer_transformation": "softmax", "layer_norm": True},
    "layer_max_pool": {"layer": 1, "pool": "max", "final_activation": "Sigmoid"},
}


@pytest.fixture(scope="session")
def comet_folders(tmp_path_factory) -> dict[str, Path]:
    from tests.comet_checkpoint import write_comet_folder

    lines = [line for name in ("train.src", "train.tgt") for line in (ROOT / "tests/data/tiny" / name).read_text().splitlines()]
    root = tmp_path_factory.mktemp("comet")
    return {name: write_comet_folder(root / name, lines, seed=i, **hparams) for i, (name, hparams) in enumerate(VARIANTS.items())}


def triples() -> tuple[list[str], list[str], list[str]]:
    """The tiny test split, a hypothesis per line: the reference, another line's, half of it, nothing,
    and last, the reference four times (longer than the tiny XLM-R's 62 pieces: cut)."""
    hyps = [REFS[i] if i % 4 == 0 else REFS[(i + 3) % len(REFS)] if i % 4 == 1
            else " ".join(REFS[i].split()[: len(REFS[i].split()) // 2]) if i % 4 == 2 else "" for i in range(len(REFS))]
    hyps[-1] = " ".join([REFS[-1]] * 4)
    return SOURCES, hyps, REFS


def sparsemax_by_bisection(z: torch.Tensor) -> torch.Tensor:
    """The threshold tau with sum(max(z - tau, 0)) = 1, found by bisection (not by sorting)."""
    low, high = float(z.min()) - 1, float(z.max())
    for _ in range(200):
        tau = (low + high) / 2
        low, high = (tau, high) if float(torch.clamp(z - tau, min=0).sum()) > 1 else (low, tau)
    return torch.clamp(z - (low + high) / 2, min=0)


def reference_score(folder: Path, comet, src: str, hyp: str, ref: str) -> float:
    """One triple, unbatched, from the checkpoint's own tensors and hparams.yaml: Rei et al. 2020's
    estimator written out (the encoder is transformers', run on one unpadded sentence)."""
    state = torch.load(folder / "checkpoints/model.ckpt", weights_only=True)["state_dict"]
    hp = yaml.safe_load((folder / "hparams.yaml").read_text())
    encoder = comet.model.encoder
    layers = encoder.config.num_hidden_layers + 1

    def embed(text: str) -> torch.Tensor:
        ids = torch.tensor([comet.tokenizer.encode(text)])
        hidden = [h[0].double() for h in encoder(input_ids=ids, output_hidden_states=True).hidden_states]  # (S, H) each
        if hp["layer"] == "mix":
            w = torch.cat([state[f"layerwise_attention.scalar_parameters.{i}"] for i in range(layers)]).double()
            w = sparsemax_by_bisection(w) if hp["layer_transformation"] == "sparsemax" else torch.softmax(w, 0)
            if hp["layer_norm"]:
                hidden = [(h - h.mean()) / torch.sqrt(h.var(unbiased=False) + 1e-12) for h in hidden]
            mixed = state["layerwise_attention.gamma"].double() * sum(wi * h for wi, h in zip(w, hidden))
        else:
            mixed = hidden[hp["layer"]]
        return mixed.max(0).values if hp["pool"] == "max" else mixed.mean(0)

    with torch.no_grad():
        s, h, r = embed(src), embed(hyp), embed(ref)
        x = torch.cat([h, r, h * r, (h - r).abs(), h * s, (h - s).abs()])
        for j in range(len(hp["hidden_sizes"]) + 1):
            x = state[f"estimator.ff.{3 * j}.weight"].double() @ x + state[f"estimator.ff.{3 * j}.bias"].double()
            if j < len(hp["hidden_sizes"]):
                x = torch.tanh(x)
        if hp.get("final_activation") == "Sigmoid":
            x = torch.sigmoid(x)
    return float(x)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_scores_equal_the_sentence_at_a_time_computation(comet_folders, variant):
    folder = comet_folders[variant]
    comet = load_comet(folder, batch_size=3)  # batches of 3 sentences of different lengths: padding in every batch
    sources, hyps, refs = (x[:12] for x in triples())
    scores = comet.score(sources, hyps, refs)
    expected = [reference_score(folder, comet, s, h, r) for s, h, r in zip(sources, hyps, refs)]
    np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0)
    assert np.ptp(scores) > 1e-3  # the scores differ: a head that read nothing would give one number


def test_scores_are_deterministic_and_follow_their_sentences(comet_folders):
    sources, hyps, refs = triples()
    first = load_comet(comet_folders["sparsemax"], batch_size=4).score(sources, hyps, refs)
    again = load_comet(comet_folders["sparsemax"], batch_size=7)
    order = np.random.default_rng(0).permutation(len(sources))
    shuffled = again.score(*([x[i] for i in order] for x in (sources, hyps, refs)))
    np.testing.assert_allclose(shuffled, first[order], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(again.score(sources, hyps, refs), again.score(sources, hyps, refs))


def test_tokenizer_gives_transformers_xlmr_ids(comet_folders):
    from transformers import XLMRobertaTokenizer

    folder = comet_folders["sparsemax"]
    theirs = XLMRobertaTokenizer.from_pretrained(str(folder / "encoder"))
    ours = load_comet(folder).tokenizer
    texts = [*SOURCES, *REFS, "", "  spaced  out ", "Ünïcödé 123 ?!", "x " * 100]
    for text in texts:
        assert ours.encode(text) == theirs(text, truncation=True, max_length=ours.max_length)["input_ids"], text


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_scores_equal_the_comet_package(comet_folders, variant):
    """COMET's own ``predict`` on the same folder (its hparams name the encoder folder)."""
    comet_package = pytest.importorskip("comet", reason="unbabel-comet is not installed (it pins transformers<5)")
    folder = comet_folders[variant]
    sources, hyps, refs = triples()
    model = comet_package.load_from_checkpoint(str(folder / "checkpoints/model.ckpt"), local_files_only=True)
    theirs = model.predict([{"src": s, "mt": h, "ref": r} for s, h, r in zip(sources, hyps, refs)], batch_size=4,
                           gpus=0, accelerator="cpu", progress_bar=False)
    ours = load_comet(folder, batch_size=5).score(sources, hyps, refs)
    np.testing.assert_allclose(ours, theirs.scores, atol=1e-5, rtol=0)
    assert ours.mean() == pytest.approx(theirs.system_score, abs=1e-5)


def test_by_length_buckets_hold_their_sentences_means_and_intervals():
    sources, hyps, refs = triples()
    scores = np.random.default_rng(1).normal(size=len(sources))
    report = length_report(sources, hyps, refs, [5, 10], n_bootstrap=50)
    segment_scores.add_to_report(report, scores, sources, [5, 10], n_bootstrap=200, seed=7, about={"model": "m"})
    for bucket, index in zip(report["buckets"], bucket_indices(sources, [5, 10])):
        if len(index) == 0:
            assert bucket["comet"] is None and bucket["comet_ci_low"] is None
            continue
        assert bucket["comet"] == pytest.approx(scores[index].mean())
        draws = np.random.default_rng(7).multinomial(len(index), np.full(len(index), 1 / len(index)), size=200)
        means = [np.repeat(scores[index], w).mean() for w in draws]  # each resample's sentences, written out
        assert [bucket["comet_ci_low"], bucket["comet_ci_high"]] == pytest.approx(np.percentile(means, [2.5, 97.5]))
    assert report["comet"] == pytest.approx(scores.mean()) and report["comet_ci"][0] < scores.mean() < report["comet_ci"][1]
    assert report["comet_settings"] == {"model": "m", "bootstrap": {"resamples": 200, "seed": 7}}
    with pytest.raises(ValueError, match="^19 comet scores for a report of 20 sentences$"):
        segment_scores.add_to_report(report, scores[:-1], sources, [5, 10])


def sacrebleu_paired_bootstrap(a: np.ndarray, b: np.ndarray, n: int, seed: int) -> tuple[float, float, float]:
    """sacreBLEU's paired bootstrap (``_paired_bootstrap_resampling``) with the mean as the metric, a resample at a time."""
    idx = np.random.default_rng(seed).choice(len(a), size=(n, len(a)), replace=True)
    diffs = np.array([a[i].mean() - b[i].mean() for i in idx])
    stats = np.abs(diffs) - np.abs(diffs).mean()
    p = (np.sum(stats > abs(a.mean() - b.mean())) + 1) / (n + 1)
    return float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5)), float(p)


def test_paired_test_is_sacrebleus_paired_bootstrap_on_segment_scores():
    sources, hyps, refs = triples()
    rng = np.random.default_rng(3)
    base = rng.normal(size=len(sources))
    scores = {"base": base, "better": base + 0.3 + 0.1 * rng.normal(size=len(base)), "same": base.copy()}
    named = {"base": hyps, "better": [h + " x" for h in hyps], "same": list(hyps)}
    buckets = list(zip(["1-5", "6-10", ">10"], bucket_indices(sources, [5, 10])))
    out = segment_scores.paired(scores, named, "base", buckets, bootstrap=300, seed=11, min_sentences=3, randomization=5)
    assert set(out) == {"better", "same"}
    rows = {r["bucket"]: r for r in out["better"]["rows"]}
    low, high, p = sacrebleu_paired_bootstrap(scores["better"], base, 300, 11)
    assert [rows["all"]["delta_ci_low"], rows["all"]["delta_ci_high"], rows["all"]["p_bootstrap"]] == pytest.approx([low, high, p])
    assert rows["all"]["delta"] == pytest.approx(scores["better"].mean() - base.mean()) and p == pytest.approx(1 / 301)
    assert all(r["delta"] == 0.0 and r["p_bootstrap"] == 1.0 for r in out["same"]["rows"] if r["count"])
    few = segment_scores.paired(scores, named, "base", buckets, bootstrap=300, seed=11, min_sentences=100)
    assert all(r["p_bootstrap"] is None and r["delta"] is not None for r in few["better"]["rows"] if r["count"])
    table = segment_scores.markdown({"better": {"comet_vs_baseline": out["better"]}})
    assert "| better vs base | all | 20 | 20 | +0." in table and f"| {p:.4f} |" in table


def test_evaluate_reports_comet_beside_bleu(comet_folders, tmp_path, capsys):
    sources, hyps, refs = triples()
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("\n".join(refs) + "\n")
    bad.write_text("\n".join(hyps) + "\n")
    out = tmp_path / "eval"
    result = evaluate_here(capsys, out, "data=tiny", f"hyps={{good: {good}, bad: {bad}}}", "baseline=bad",
                           "length_buckets=[5,10]", "n_bootstrap=20", "significance.bootstrap=100",
                           "significance.randomization=0", "significance.min_sentences=3", "word_frequency=false",
                           "reordering=false", f"comet.model={comet_folders['sparsemax']}", "comet.batch_size=8",
                           f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr
    comet = load_comet(comet_folders["sparsemax"])
    expected = {"good": comet.score(sources, refs, refs), "bad": comet.score(sources, hyps, refs)}
    report = json.loads((out / "comparison.json").read_text())
    for name in ("good", "bad"):
        assert report[name]["comet"] == pytest.approx(expected[name].mean(), abs=1e-6)
        assert report[name]["comet_segments"] == pytest.approx(list(expected[name]), abs=1e-6)
        assert f"{name}: BLEU {report[name]['bleu']:.2f}, chrF {report[name]['chrf']:.2f}, COMET {expected[name].mean():.4f}" in result.stderr
        header = (out / name / "bleu_by_length.csv").read_text().splitlines()[0]
        assert header.endswith(",length_ratio,comet,comet_ci_low,comet_ci_high")
    table = (out / "comparison.md").read_text()
    assert "| source length (words) | sentences | good BLEU [95% CI] | bad BLEU [95% CI] | good COMET [95% CI] | bad COMET [95% CI] |" in table
    assert "COMET: paired bootstrap against `bad` on segment scores (100 resamples, seed 12345):" in table
    rows = report["good"]["comet_vs_baseline"]["rows"]
    assert rows[-1]["delta"] == pytest.approx(expected["good"].mean() - expected["bad"].mean(), abs=1e-6)
    csv_header = (out / "comparison.csv").read_text().splitlines()[0]
    assert csv_header.endswith("p_randomization,comet,comet_ci_low,comet_ci_high,delta_comet,delta_comet_ci_low,"
                               "delta_comet_ci_high,p_bootstrap_comet")


def test_a_missing_folder_names_the_key(tmp_path, capsys):
    with pytest.raises(CometRefused, match=r"^comet\.model=/nonexistent/wmt22-comet-da: no such folder; download "
                                           r"wmt22-comet-da where there is internet \(huggingface-cli download "):
        load_comet("/nonexistent/wmt22-comet-da")
    result = evaluate_here(capsys, tmp_path / "eval", "data=tiny", f"hyps={{a: {ROOT / 'tests/data/tiny/test.tgt'}}}",
                           "comet.model=/nonexistent/wmt22-comet-da", f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 2 and "comet.model=/nonexistent/wmt22-comet-da: no such folder" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    (tmp_path / "model").mkdir()
    with pytest.raises(CometRefused, match=r"^comet\.encoder=.*model/encoder: no such folder; it holds xlm-roberta-large's"):
        load_comet(tmp_path / "model")


def test_without_transformers_the_error_names_the_extra(comet_folders, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(CometRefused, match=r"^COMET needs transformers' XLM-R: pip install 'nmt\[comet\]'$"):
        load_comet(comet_folders["sparsemax"])


def copy_folder(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_folders_nmt_cannot_read_are_refused_in_one_line(comet_folders, tmp_path):
    folder = copy_folder(comet_folders["sparsemax"], tmp_path / "c")
    hparams = yaml.safe_load((folder / "hparams.yaml").read_text())
    (folder / "hparams.yaml").write_text(yaml.safe_dump({**hparams, "class_identifier": "unified_metric"}))
    with pytest.raises(CometRefused, match=r"hparams\.yaml: class_identifier='unified_metric'; nmt computes class_identifier=regression_metric"):
        load_comet(folder)
    (folder / "hparams.yaml").write_text(yaml.safe_dump({**hparams, "hidden_sizes": [32, 10**9]}))
    with pytest.raises(CometRefused, match=r"hidden_sizes=\[32, 1000000000\]: 1 to 8 widths from 1 to 65536$"):
        load_comet(folder)
    (folder / "hparams.yaml").write_text(yaml.safe_dump(hparams))
    config = json.loads((folder / "encoder/config.json").read_text())
    (folder / "encoder/config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**6}))
    with pytest.raises(CometRefused, match=r"config\.json: num_hidden_layers=1000000: a whole number from 1 to 64$"):
        load_comet(folder)
    (folder / "encoder/config.json").write_text(json.dumps({**config, "hidden_size": 32, "intermediate_size": 64}))
    with pytest.raises(CometRefused, match=r"model\.ckpt: encoder\.model\.embeddings\.word_embeddings\.weight has shape "
                                           r"\(\d+, 16\), the model hparams\.yaml and config\.json describe needs \(\d+, 32\)$"):
        load_comet(folder)
    (folder / "encoder/config.json").write_text(json.dumps(config))
    ckpt = torch.load(folder / "checkpoints/model.ckpt", weights_only=True)
    torch.save({**ckpt, "callbacks": {"x": Path("/tmp")}}, folder / "checkpoints/model.ckpt")  # a pickled object
    with pytest.raises(CometRefused, match=r"model\.ckpt: holds more than tensors and plain values \(pathlib\.\w+\), "
                                           r"which nmt never unpickles$"):
        load_comet(folder)
    ckpt["state_dict"]["estimator.ff.9.weight"] = torch.zeros(1)
    torch.save(ckpt, folder / "checkpoints/model.ckpt")
    with pytest.raises(CometRefused, match=r"estimator\.ff\.9\.weight is not a weight of the COMET model hparams\.yaml describes$"):
        load_comet(folder)


def test_study_adds_comet_to_its_table_and_tests_it_against_the_first_model(comet_folders, tmp_path, monkeypatch):
    from nmt import study
    from tests.test_study import REFS as STUDY_REFS, SOURCES as STUDY_SOURCES, fake_run

    systems = {"lstm": ["x", "x y", "x"], "lstm_bahdanau": STUDY_REFS}
    for model, hyps in systems.items():
        fake_run(tmp_path / model, model, hyps)
        for name, lines in (("sources", STUDY_SOURCES), ("hyps", hyps), ("refs", STUDY_REFS)):
            (tmp_path / model / f"test_{name}.txt").write_text("".join(line + "\n" for line in lines))
    comet = load_comet(comet_folders["sparsemax"])
    study.collect(tmp_path, 0, comet)  # nmt-study --collect <dir> --heatmaps 0 --comet <folder>
    means = {m: load_comet(comet_folders["sparsemax"]).score(STUDY_SOURCES, h, STUDY_REFS).mean() for m, h in systems.items()}
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert lines[0].endswith("| BLEU 1-10 | BLEU >20 | test COMET |")
    assert lines[2].endswith(f" {means['lstm']:.4f} |") and lines[3].endswith(f" {means['lstm_bahdanau']:.4f} |")
    report = json.loads((tmp_path / "comparison" / "comparison.json").read_text())
    rows = report["lstm_bahdanau"]["comet_vs_baseline"]["rows"]
    assert [r["bucket"] for r in rows] == ["1-10", "11-20", ">20", "all"]
    assert rows[-1]["delta"] == pytest.approx(means["lstm_bahdanau"] - means["lstm"], abs=1e-6)
    (tmp_path / "lstm_bahdanau" / "test_refs.txt").write_text("other\n" * len(STUDY_REFS))
    with pytest.raises(SystemExit, match=r"^nmt-study: --comet: .*lstm_bahdanau and .*lstm were tested on different "
                                         r"sentences; the paired test needs one test set$"):
        study.collect(tmp_path, 0, comet)
    (tmp_path / "lstm" / "test_refs.txt").unlink()
    with pytest.raises(SystemExit, match=r"^nmt-study: --comet: .*lstm/test_refs\.txt is missing \(a run trained before "
                                         r"runs kept their references\); score it with evaluate\.py comet\.model=<folder>$"):
        study.collect(tmp_path, 0, comet)
    monkeypatch.setattr(sys, "argv", ["nmt-study", "--collect", str(tmp_path), "--comet", "/nonexistent"])
    with pytest.raises(SystemExit, match=r"^nmt-study: --comet: comet\.model=/nonexistent: no such folder"):
        study.main()


def test_weights_from_safetensors_score_as_the_checkpoint(comet_folders, tmp_path):
    from safetensors.torch import save_file

    folder = copy_folder(comet_folders["softmax_layer_norm"], tmp_path / "c")
    state = torch.load(folder / "checkpoints/model.ckpt", weights_only=True)["state_dict"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "checkpoints/model.safetensors"))
    (folder / "checkpoints/model.ckpt").unlink()
    sources, hyps, refs = triples()
    np.testing.assert_array_equal(load_comet(folder).score(sources, hyps, refs),
                                  load_comet(comet_folders["softmax_layer_norm"]).score(sources, hyps, refs))
    del state["layerwise_attention.gamma"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "checkpoints/model.safetensors"))
    with pytest.raises(CometRefused, match=r"model\.safetensors: layerwise_attention\.gamma is missing \(1 weights in all\)$"):
        load_comet(folder)

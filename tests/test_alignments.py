"""Word alignments (nmt.inference.alignments): Pharaoh links from hand-built attention, the alignment error
rate, the synthetic generator's gold alignments, and decoding.alignments=true in translate,
n-best lists and the server for every model."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from nmt.inference.alignments import aer, parse, pharaoh, word_of_pieces
from nmt.data.synthetic import generate_pairs, gold_alignment
from nmt.data.tokenizer import BOS
from nmt.inference.translator import Translator, encode_sources, pad
from nmt.serve.guard import parse_request
from nmt.train import train
from tests.conftest import ROOT, compose_train, translate_here

LINES = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()[:6]


def test_pieces_are_lifted_to_words_and_each_target_piece_links_its_strongest_source_piece():
    assert word_of_pieces(["▁ein", "▁ha", "us", "▁", "."]) == [0, 1, 1, 2, 2]
    source = ["▁das", "▁ha", "us", "▁ist"]        # words: das haus ist
    target = ["▁the", "▁house", "▁is", "▁bi", "g"]  # words: the house is big
    weights = [[0.7, 0.1, 0.1, 0.1, 0.0],    # the -> das (the last column: EOS, never linked)
               [0.1, 0.2, 0.6, 0.1, 0.9],    # house -> haus (its second piece)
               [0.1, 0.1, 0.1, 0.7, 0.0],    # is -> ist
               [0.2, 0.5, 0.2, 0.1, 0.0],    # bi -> haus
               [0.1, 0.1, 0.1, 0.7, 0.0]]    # g -> ist: big links haus and ist
    assert pharaoh(source, target, weights) == "0-0 1-1 2-2 1-3 2-3"
    assert pharaoh([], target, weights) == "" and pharaoh(source, [], weights) == ""


def test_alignment_error_rate_counts_sure_and_possible_links():
    hyp, sure = [{(0, 0), (1, 1)}], [{(0, 0), (1, 2)}]
    assert aer(hyp, sure) == pytest.approx(0.5)  # 1 - (1 + 1) / (2 + 2)
    assert aer(hyp, sure, [{(1, 1)}]) == pytest.approx(0.25)  # (1,1) possible: 1 - (1 + 2) / 4
    assert aer(sure, sure) == 0.0 and aer([set()], [{(0, 0)}]) == 1.0
    assert parse("0-0 2-1 3p4") == {(0, 0), (2, 1), (3, 4)}
    with pytest.raises(ValueError, match=re.escape("line 3: 'a-1' is not a link 'source-target' of two word indices")):
        parse("0-0 a-1", where="line 3")
    with pytest.raises(ValueError, match="1 hypotheses, 2 sure"):
        aer(hyp, sure * 2)


def test_the_synthetic_gold_alignment_is_one_to_one_and_follows_the_grammar():
    src, tgt = generate_pairs(1, seed=54, min_len=12, max_len=12)[0]  # the module docstring's example
    assert gold_alignment(src) == "0-0 2-1 1-2 3-3 5-4 7-5 6-6 4-7 11-8 9-9 10-10 8-11"
    for src, tgt in generate_pairs(200, seed=3, min_len=3, max_len=60):
        links = parse(gold_alignment(src))
        n = len(src.split())
        assert len(tgt.split()) == n and {s for s, _ in links} == {t for _, t in links} == set(range(n))
        assert len(links) == n


@pytest.fixture(scope="module", params=["lstm", "lstm_bahdanau", "lstm_luong", "transformer"])
def model_run(request, tmp_path_factory):
    cfg = compose_train(tmp_path_factory.mktemp(request.param), ["trainer.max_epochs=1", "test=false"],
                        model=request.param)
    train(cfg)
    return request.param, Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


def test_translate_writes_an_alignment_beside_each_translation(model_run, tmp_path, capsys):
    name, ckpt = model_run
    src = tmp_path / "in.txt"
    src.write_text("\n".join([*LINES[:3], "", *LINES[3:]]) + "\n")
    result = translate_here(capsys, f"ckpt={ckpt}", f"input={src}", "decoding=greedy", "decoding.alignments=true")
    assert result.returncode == 0, result.stderr[-2000:]
    plain = translate_here(capsys, f"ckpt={ckpt}", f"input={src}", "decoding=greedy").stdout.splitlines()
    rows = result.stdout.splitlines()
    assert len(rows) == 7 and rows[3] == "\t"
    for row, text, line in zip(rows, plain, [*LINES[:3], "", *LINES[3:]]):
        out, alignment = row.split("\t")
        assert out == text
        links = parse(alignment)
        if name == "lstm" or not line:  # no attention, or nothing to align
            assert links == set()
        else:
            assert {t for _, t in links} == set(range(len(out.split())))  # every output word is linked
            assert all(s < len(line.split()) for s, _ in links)


def test_nbest_lists_and_json_lines_carry_one_alignment_per_hypothesis(model_run, tmp_path, capsys):
    name, ckpt = model_run
    src = tmp_path / "in.txt"
    src.write_text("\n".join(LINES[:2]) + "\n")
    result = translate_here(capsys, f"ckpt={ckpt}", f"input={src}", "decoding.beam_size=3", "decoding.nbest=3",
                            "decoding.alignments=true", "format=jsonl")
    rows = [json.loads(r) for r in result.stdout.splitlines()]
    assert len(rows) == 6 and all("alignment" in r for r in rows)
    best = translate_here(capsys, f"ckpt={ckpt}", f"input={src}", "decoding.beam_size=3", "decoding.alignments=true",
                          "format=jsonl").stdout.splitlines()
    for row in rows:
        assert (row["alignment"] == "") == (name == "lstm" or not row["text"])
        if row["rank"] == 1:  # the one-best output's hypothesis, aligned alike
            one = json.loads(best[row["line"] - 1])
            assert (one["text"], one["alignment"]) == (row["text"], row["alignment"])


def test_the_alignment_reads_the_attention_the_search_computed(model_run):
    """Teacher-forced attention over a greedy output equals the search's own (RNNs: their
    attention; Transformers: the last layer averaged over heads, what decoding returns)."""
    name, ckpt = model_run
    if name == "lstm":
        pytest.skip("no attention")
    translator = Translator.load(ckpt, precision="32",  # as the greedy search it is compared with
                                 decoding={"_target_": "nmt.decoding.search.greedy_search", "_partial_": True})
    for translation, line in zip(translator.translate(LINES, attention=True), LINES):
        source = encode_sources([line], translator.src_vocab, translator.max_src_len)
        # the searched ids themselves (from the attention's pieces; the text may re-encode otherwise)
        target = [translator.tgt_vocab.sp.piece_to_id(p) for p in translation.attention.target[:-1]]
        src, src_mask = pad(source, translator.device)
        tgt_in, _ = pad([[BOS, *target]], translator.device)
        with torch.inference_mode():
            forced = translator.model.cross_attention(src, src_mask, tgt_in)[0, -1].mean(0)
        searched = torch.tensor(translation.attention.weights)
        assert searched.shape == forced.shape == (len(target) + 1, len(source[0]))
        torch.testing.assert_close(forced, searched, atol=1e-4, rtol=1e-4)


def test_the_server_answers_alignments_when_asked(serve_ckpt):
    from fastapi.testclient import TestClient

    from nmt.serve.app import create_app, load
    from tests.conftest import serve_cfg

    cfg = serve_cfg(serve_ckpt, "batching.process=false")
    with TestClient(create_app(load(cfg), cfg)) as client:
        body = client.post("/translate", json={"text": LINES[:2], "alignments": True, "beam_size": 2, "nbest": 2}).json()
        for item in body["translations"]:
            assert set(item) >= {"text", "score", "alignment", "nbest"}
            assert all("alignment" in h for h in item["nbest"]) and item["nbest"][0]["alignment"] == item["alignment"]
        plain = client.post("/translate", json={"text": LINES[:2]}).json()["translations"]
        assert all("alignment" not in item for item in plain)
        assert [t["text"] for t in plain] == [t["text"] for t in client.post(
            "/translate", json={"text": LINES[:2], "alignments": True}).json()["translations"]]
        bad = client.post("/translate", json={"text": ["a"], "alignments": "yes"})
        assert bad.status_code == 400 and bad.json()["error"] == '"alignments" must be true or false, not "yes"'
    cfg = serve_cfg(serve_ckpt, "batching.process=false", "decoding.alignments=true")  # on unless a request says false
    with TestClient(create_app(load(cfg), cfg)) as client:
        assert all("alignment" in t for t in client.post("/translate", json={"text": LINES[:2]}).json()["translations"])
        off = client.post("/translate", json={"text": LINES[:2], "alignments": False}).json()["translations"]
        assert all("alignment" not in t for t in off)


def test_a_server_on_an_older_ctranslate2_export_refuses_alignments_and_guides():
    from omegaconf import OmegaConf

    limits = OmegaConf.create({"max_sentences": 10, "max_chars": 100, "max_beam_size": 5})
    answer = parse_request(b'{"text": ["a"], "alignments": true}', limits, 5, can_align=False)
    assert answer.status_code == 400 and b"exported before nmt-export kept every head's attention" in answer.body
    from nmt.inference.requests import RequestError, RequestMeaning
    from nmt.serve.app import naming

    class Export(RequestMeaning):  # what the server asks of a CTranslate2 folder's translator
        backend, target_languages = "ctranslate2", []

    request, _ = parse_request(b'{"text": ["a"], "prefix": ["b"]}', limits, 5)
    with pytest.raises(RequestError, match='^"prefix": prefixes are decoded by the torch backend, not by ctranslate2$'):
        Export().prepare(request, naming(1))


def test_decoding_alignments_must_be_a_boolean(serve_ckpt, capsys):
    result = translate_here(capsys, f"ckpt={serve_ckpt}", "decoding.alignments=1")
    assert result.returncode == 2 and "error: decoding.alignments=1: give true or false" in result.stderr


def test_alignments_of_random_sentences_link_only_real_words(serve_ckpt):
    translator = Translator.load(serve_ckpt)
    rng = random.Random(0)
    words = " ".join(LINES).split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(20)]
    for translation, line in zip(translator.translate(lines, alignments=True), lines):
        links = parse(translation.hypotheses[0].alignment)
        assert all(s < len(line.split()) and t < len(translation.text.split()) for s, t in links)


def test_a_side_written_without_spaces_is_aligned_in_characters():
    """Chinese target pieces lifted to characters (each piece to its first one, "▁" not counted),
    where words would make the whole clause one word; a tagged source's offset in characters too."""
    from nmt.inference.alignments import unit_of_pieces

    target = ["▁我", "喜欢", "猫", "。"]  # one whitespace word, five characters
    assert word_of_pieces(target) == [0, 0, 0, 0] and unit_of_pieces(target, "chars") == [0, 1, 3, 4]
    source = ["▁I", "▁like", "▁cats", "▁."]
    weights = [[0.9, 0.0, 0.0, 0.1], [0.0, 0.9, 0.0, 0.1], [0.0, 0.0, 0.9, 0.1], [0.0, 0.1, 0.0, 0.9]]
    assert pharaoh(source, target, weights) == "0-0 1-0 2-0 3-0"
    assert pharaoh(source, target, weights, units=("words", "chars")) == "0-0 1-1 2-3 3-4"
    tagged = ["▁<2zh>", "▁我", "喜欢"]
    assert pharaoh(tagged, ["▁I", "▁like"], [[0.0, 0.9, 0.1], [0.0, 0.1, 0.9]], skip=1, units=("chars", "words")) == "0-0 1-1"
    with pytest.raises(ValueError, match="alignment unit must be 'words' or 'chars', got 'tokens'"):
        unit_of_pieces(target, "tokens")

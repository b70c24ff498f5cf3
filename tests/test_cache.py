"""nmt.data.cache: which prepared folders are current, stale, kept or partial, what pruning
deletes (and what it never touches), and the command."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nmt.data import cache
from nmt.data.prepare import prepare
from nmt.data.sources import FileSource, SyntheticSource
from tests.test_prepare import TOKENIZER, corpus

DAY = 86400


def age(path: Path, days: float) -> None:
    then = time.time() - days * DAY
    os.utime(path, (then, then))


def test_states_and_what_prune_deletes(tmp_path):
    data = corpus(tmp_path)
    old, _ = prepare(FileSource(str(data), "src", "tgt"), tmp_path, TOKENIZER, workers=0)
    assert [(e.folder, e.state) for e in cache.entries(tmp_path)] == [(old, "current")]

    with (data / "train.src").open("a") as f:  # the corpus is edited: a new folder, the old one stale
        f.write("one more line\n")
    with (data / "train.tgt").open("a") as f:
        f.write("one more line\n")
    new, built = prepare(FileSource(str(data), "src", "tgt"), tmp_path, TOKENIZER, workers=0)
    assert built and new != old
    generated, _ = prepare(SyntheticSource(num_pairs=50, valid_pairs=10, test_pairs=10), tmp_path, TOKENIZER, workers=0)
    partial = tmp_path / "prepared" / ".tmp-0123-abc"
    partial.mkdir()
    (partial / "train.src.text.npy").write_bytes(b"x" * 100)
    broken = tmp_path / "prepared" / "0000000000000000"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")

    states = {e.folder: (e.state, e.reason) for e in cache.entries(tmp_path)}
    assert states[old] == ("stale", f"{(data / 'train.src').resolve()} changed since it was prepared")
    assert states[new][0] == "current" and states[generated][0] == "kept"
    assert states[partial] == ("partial", "a preparation that did not finish")
    assert states[broken] == ("stale", "no readable manifest.json (JSONDecodeError)")

    # a partial folder written to within partial_hours may be a preparation running now
    assert {e.folder for e in cache.prune(tmp_path, dry_run=True)} == {old, broken}
    assert old.is_dir() and broken.is_dir()  # dry run
    assert {e.folder for e in cache.prune(tmp_path)} == {old, broken}
    assert not old.exists() and not broken.exists() and new.is_dir() and generated.is_dir()

    age(partial / "train.src.text.npy", 2)
    age(generated / "manifest.json", 40)
    assert {e.folder for e in cache.prune(tmp_path, unused_days=60)} == {partial}
    assert {e.folder for e in cache.prune(tmp_path, unused_days=30)} == {generated}
    assert [e.folder for e in cache.entries(tmp_path)] == [new]


def test_opening_a_folder_marks_it_used(tmp_path):
    source = FileSource(str(corpus(tmp_path)), "src", "tgt")
    folder, _ = prepare(source, tmp_path, TOKENIZER, workers=0)
    age(folder / "manifest.json", 40)
    assert cache.to_delete(cache.entries(tmp_path), unused_days=30)
    assert prepare(source, tmp_path, TOKENIZER, workers=0) == (folder, False)
    assert not cache.to_delete(cache.entries(tmp_path), unused_days=30)
    # a file gone makes it stale as well
    (Path(source.path) / "valid.tgt").unlink()
    (entry,) = cache.entries(tmp_path)
    assert entry.state == "stale" and entry.reason.endswith("valid.tgt is gone")


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_cache_command_lists_and_prunes(tmp_path):
    data = corpus(tmp_path)
    folder, _ = prepare(FileSource(str(data), "src", "tgt"), tmp_path, TOKENIZER, workers=0)
    (data / "test.src").write_text("changed\n" * 20)

    def command(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "nmt.data.cache", f"paths.cache_dir={tmp_path}", *args],
                                capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    out = command()
    assert f"| {folder.name} | stale |" in out and "test.src changed since it was prepared" in out
    assert "would delete 1 folder, " in command("prune=true", "dry_run=true") and folder.is_dir()
    assert "deleted 1 folder, " in command("prune=true") and not folder.exists()
    assert f"no prepared data under {tmp_path / 'prepared'}" in command()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "prepared"]  # no run folder, no log file
    assert not any((tmp_path / "prepared").iterdir())

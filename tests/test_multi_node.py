"""Two nodes on one machine: one torchrun agent per node (`--nnodes=2 --nproc-per-node=1`, gloo
over loopback) each running `train.py`, with a cache folder per node (no shared disk) or one
folder both nodes prepare into at once (a cluster file system)."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed

import nmt.data.prepare
from nmt.data.prepare import TMP_PREFIX, prepare
from nmt.data.sources import DataError, FileSource
from nmt.data.tokenizer import Tokenizer
from tests.conftest import KERNELS, ROOT, TINY
from tests.test_datamodule import TOKENIZER, tiny

HANG_GUARD = 300  # seconds both nodes together may take before the test kills them and fails

TWO_NODES = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=1", "trainer.num_nodes=2",
             "trainer.precision=32-true", "trainer.max_epochs=-1", "trainer.val_check_interval=2",
             "trainer.check_val_every_n_epoch=null", "callbacks.cpu_threads=null"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(tmp_path: Path, name: str, per_node: list[list[str]]) -> list[str]:
    """Start node 0 and node 1 (`per_node[i]`: that node's extra overrides) and wait for both;
    returns each node's output. Fails with the output of both if one fails or they hang."""
    port = free_port()
    logs = [tmp_path / f"{name}.node{rank}.log" for rank in range(2)]
    procs = []
    for rank, extra in enumerate(per_node):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                   f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
                   "train.py", *TINY, f"kernels={KERNELS[0]}", *TWO_NODES, *extra]
        with open(logs[rank], "w") as out:  # a file, not a pipe: a node never blocks on unread output
            procs.append(subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    try:
        codes = [p.wait(timeout=HANG_GUARD) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:  # the agents and their workers, should any still run
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    outputs = [log.read_text() for log in logs]
    tails = "\n".join(f"--- node {rank} ---\n{out[-3000:]}" for rank, out in enumerate(outputs))
    assert codes is not None, f"the nodes did not finish within {HANG_GUARD}s\n{tails}"
    assert codes == [0, 0], f"exit codes {codes}\n{tails}"
    return outputs


def prepared_folders(cache: Path) -> list[Path]:
    return sorted((cache / "prepared").iterdir())


def logged_steps(run: Path) -> list[int]:
    with open(run / "csv" / "metrics.csv") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_two_nodes_share_one_cache_train_and_resume(tmp_path):
    """Both nodes start on one empty cache folder: one prepared folder results, and no temporary
    one is left (the race itself: the test above). The 2-node run validates and checkpoints;
    resumed from its last.ckpt on 2 nodes, the global step goes on from where it stopped."""
    cache, run, resumed = tmp_path / "cache", tmp_path / "run", tmp_path / "resumed"
    shared = [f"paths.cache_dir={cache}", "trainer.max_steps=4", "test=false"]
    outputs = run_nodes(tmp_path, "first", [[*shared, f"hydra.run.dir={run}"]] * 2)
    (folder,) = prepared_folders(cache)  # no second copy, no .tmp-* left behind
    assert (folder / "manifest.json").is_file()
    assert sum("tokenized data: built" in out for out in outputs) <= 1  # the other node used that folder
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["hardware"]["num_nodes"] == 2
    assert "val/bleu" in summary["metrics"]
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_file()

    again = [f"paths.cache_dir={cache}", "trainer.max_steps=8", f"ckpt_path={last}", f"hydra.run.dir={resumed}"]
    run_nodes(tmp_path, "resumed", [again] * 2)
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["resumed_from"] == str(last)
    assert max(logged_steps(run)) + 1 == min(logged_steps(resumed)) == 4  # the steps go on: 0-3, then 4-7
    assert "test/bleu" in summary["metrics"]  # both nodes tested the best checkpoint together
    assert prepared_folders(cache) == [folder]


def test_a_folder_another_node_prepared_meanwhile_is_used(tmp_path, monkeypatch):
    """Two nodes start preparing the same corpus into one cache folder; the one that finishes
    second finds the folder there, uses it and leaves no copy or temporary folder behind."""
    cache, read, other = tmp_path / "cache", nmt.data.prepare._read_split, []

    def read_while_another_node_prepares(source, split, out, src_words):
        if not other:  # the other node started at the same time and finishes first
            monkeypatch.setattr(nmt.data.prepare, "_read_split", read)
            other.append(prepare(source, cache, TOKENIZER, workers=0))
        return read(source, split, out, src_words)

    monkeypatch.setattr(nmt.data.prepare, "_read_split", read_while_another_node_prepares)
    source = FileSource(str(ROOT / "tests" / "data" / "tiny"), "src", "tgt")
    folder, written = prepare(source, cache, TOKENIZER, workers=0)
    assert other == [(folder, True)] and not written
    assert prepared_folders(cache) == [folder] and not folder.name.startswith(TMP_PREFIX)


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_two_nodes_with_a_cache_each_prepare_the_same_data(tmp_path):
    """No shared disk: each node's local rank 0 prepares its own copy of the corpus, and both
    copies hold the same tokenizer (a different one would train two models under one DDP)."""
    caches = [tmp_path / "cache0", tmp_path / "cache1"]
    per_node = [[f"paths.cache_dir={caches[rank]}", f"hydra.run.dir={tmp_path / f'run{rank}'}", "trainer.max_steps=2",
                 "test=false"] for rank in range(2)]
    outputs = run_nodes(tmp_path, "own", per_node)
    assert all("tokenized data: built" in out for out in outputs)
    folders = [folder for cache in caches for folder in prepared_folders(cache)]
    assert len(folders) == 2
    vocabularies = [Tokenizer(folder / "spm.model") for folder in folders]
    assert vocabularies[0].pieces_digest == vocabularies[1].pieces_digest
    assert vocabularies[0].fingerprint != vocabularies[1].fingerprint  # each trained in its own folder
    assert json.loads((tmp_path / "run0" / "summary.json").read_text())["steps"] == 2
    assert not (tmp_path / "run1" / "summary.json").exists()  # rank 0 alone writes the summary


def test_ranks_with_another_vocabulary_stop_with_a_clear_error(tmp_path, monkeypatch):
    """The ranks compare what they opened once Lightning sets the data up: the same data pass,
    another vocabulary on one rank is an error naming it. (torch.distributed stands in for 2 ranks.)"""
    dm = tiny(tmp_path / "cache")
    dm.setup()
    other = {}  # what the second rank reports, beside this rank's own
    gathered = []

    def all_gather_object(ranks: list, mine: dict) -> None:
        gathered.append(mine)
        ranks[:] = [mine, {**mine, **other}]

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    dm.setup()  # not Lightning's call (no stage): no collective, so a rank alone may call it
    assert not gathered
    dm.setup("fit")
    assert len(gathered) == 1
    dm.setup("test")  # checked once
    assert len(gathered) == 1

    dm._ranks_checked = False
    other["src vocabulary"] = "another"
    with pytest.raises(DataError, match="different data \\(src vocabulary: "):
        dm.setup("fit")

"""Resuming on another number of processes: a checkpoint of 2 DDP ranks resumed on 1, and of 1
resumed on 2 (docs/reliability.md, "Resuming on another number of processes").

The step, the learning-rate schedule and the weights continue; the rest of the interrupted epoch
is split over the new ranks, so the epoch trains every example once (a DDP epoch may repeat a few
of its first batches at its end to give every rank as many); the per-rank token counters are
rescaled. The DDP runs are subprocesses of train.py on 2 CPU processes (gloo), as in test_scale.py.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from pytorch_lightning import Callback

from nmt.data.batching import TokenBatchSampler
from nmt.training.schedules import WarmupCosine
from nmt.train import train
from tests.conftest import KERNELS, ROOT, TINY, compose_train
from tests.test_reliability import assert_same_weights, load

pytestmark = pytest.mark.filterwarnings("ignore:The dirpath has changed")  # resuming writes a new run folder

LR, WARMUP, TOTAL = 0.01, 3, 30
# ~16 training batches an epoch on 1 process; dropout draws from the RNG states a resume restores.
RUN = ["data.max_tokens=128", "model.dropout=0.1", f"optimizer.lr={LR}", f"scheduler.warmup_steps={WARMUP}",
       f"scheduler.total_steps={TOTAL}", "test=false"]
DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


class RecordBatches(Callback):
    """Writes one JSON line per training batch to ``<out>/rank<r>.jsonl`` (epoch, global step,
    learning rate, example ids), after a first line with the step and token counter training
    starts from."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def _write(self, trainer, row: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with (self.out / f"rank{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")

    def on_train_start(self, trainer, module) -> None:
        self._write(trainer, {"start": trainer.global_step, "train_tokens": module.train_tokens})

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._write(trainer, {"epoch": trainer.current_epoch, "step": trainer.global_step,
                              "lr": trainer.optimizers[0].param_groups[0]["lr"], "ids": batch["ids"].tolist()})


def record(out: Path) -> list[str]:
    return ["+callbacks.record._target_=tests.test_resume_world_size.RecordBatches", f"+callbacks.record.out={out}"]


def recorded(out: Path, rank: int = 0) -> tuple[dict, list[dict]]:
    """(the start line, the batch lines) one rank recorded."""
    rows = [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
    return rows[0], rows[1:]


def expected_lr(step: int) -> float:
    return LR * WarmupCosine(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR), WARMUP, TOTAL).factor(step)


def on_one_process(tmp_path: Path, overrides: list[str]) -> Path:
    """train() in this process; returns its last.ckpt."""
    cfg = compose_train(tmp_path, [*RUN, *overrides])
    train(cfg)
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


def on_two_processes(tmp_path: Path, run_dir: Path, overrides: list[str]) -> str:
    """train.py on 2 CPU processes; returns its output and rank 0's log."""
    command = [sys.executable, "train.py", "model=lstm_bahdanau", *TINY, *DDP, *RUN, f"kernels={KERNELS[0]}",
               f"paths.cache_dir={tmp_path.parent / 'nmt-cache'}", f"hydra.run.dir={run_dir}", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    log = run_dir / "train.log"
    return result.stdout + result.stderr + (log.read_text() if log.is_file() else "")


# --- the sampler alone ----------------------------------------------------------------------------
def rank_samplers(lengths: np.ndarray, world: int) -> list[TokenBatchSampler]:
    return [TokenBatchSampler(lengths, max_tokens=600, seed=7, num_replicas=world, rank=r) for r in range(world)]


@pytest.mark.parametrize("worlds", [(2, 1), (1, 2), (2, 3), (3, 2), (2, 1, 2)], ids=lambda w: "-".join(map(str, w)))
@pytest.mark.parametrize("each", [1, 4])
def test_the_rest_of_an_epoch_is_split_over_the_ranks_of_the_resumed_run(worlds, each):
    """Ranks of each world train `each` batches of epoch 1, rank 0's state goes to the next world;
    the last world trains the epoch to its end. Every batch of the epoch is trained once, but for
    the padding of the last world (fewer than its ranks, from the epoch's start), and the ranks of
    every world train as many batches."""
    lengths = np.random.default_rng(0).integers(2, 120, size=1000)
    state = {"epoch": 1, "batches_yielded": 0}
    trained: list[list[int]] = []
    for i, world in enumerate(worlds):
        samplers = rank_samplers(lengths, world)
        for sampler in samplers:
            sampler.load_state_dict(state)
        passes = [iter(sampler) for sampler in samplers]
        last = i == len(worlds) - 1
        per_rank = [list(p) if last else [next(p) for _ in range(each)] for p in passes]
        assert len({len(batches) for batches in per_rank}) == 1
        if last:  # what Lightning counts as done: the rest is what each rank trained
            assert all(sampler.rank_done(state) + len(per_rank[0]) == len(sampler) for sampler in samplers)
        trained += [b for batches in per_rank for b in batches]
        state = samplers[0].state_dict()
        assert state["num_replicas"] == world
    epoch = rank_samplers(lengths, 1)[0].all_batches(1)
    counts = Counter(tuple(b) for b in trained)
    assert set(counts) == {tuple(b) for b in epoch}
    repeated = [b for b, n in counts.items() if n > 1]
    assert all(counts[b] == 2 for b in repeated) and len(repeated) < worlds[-1]
    assert set(repeated) == {tuple(b) for b in epoch[: len(repeated)]}
    assert sum(len(b) for b in trained) - sum(len(b) for b in repeated) == len(lengths)


def test_with_the_same_ranks_a_resume_yields_what_each_rank_had_left():
    lengths = np.random.default_rng(1).integers(2, 120, size=1000)
    for world in (1, 2, 3):
        uninterrupted = [s.rank_batches(0) for s in rank_samplers(lengths, world)]
        stopped = rank_samplers(lengths, world)
        for sampler in stopped:
            it = iter(sampler)
            [next(it) for _ in range(3)]
        resumed = rank_samplers(lengths, world)
        for rank, sampler in enumerate(resumed):
            sampler.load_state_dict(stopped[0].state_dict())
            assert sampler.resume_offset == 3 and list(sampler) == uninterrupted[rank][3:]


# --- training runs --------------------------------------------------------------------------------
@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_two_ranks_resume_on_one(tmp_path, caplog):
    """A 2-rank run stops at step 3 in the middle of epoch 0; resumed on 1 process, it goes on
    from step 3 at the schedule's learning rate and trains the epoch's rest: with the 2 ranks'
    batches, every training example once. The token counter carries the 2 ranks' total."""
    ddp = tmp_path / "ddp"
    on_two_processes(tmp_path, ddp, ["trainer.max_steps=3", *record(tmp_path / "ddp_batches")])
    ckpt = ddp / "checkpoints" / "last.ckpt"
    saved = load(ckpt)
    assert saved["global_step"] == 3 and saved["world_size"] == 2
    before = [row for rank in (0, 1) for row in recorded(tmp_path / "ddp_batches", rank)[1]]
    assert len(before) == 6 and {row["epoch"] for row in before} == {0}

    with caplog.at_level(logging.INFO):
        on_one_process(tmp_path / "single", [f"ckpt_path={ckpt}", *record(tmp_path / "batches")])
    start, after = recorded(tmp_path / "batches")
    assert start == {"start": 3, "train_tokens": saved["counters"]["train_tokens"] * 2}
    assert [row["step"] for row in after] == list(range(3, 3 + len(after)))
    assert after[0]["lr"] == pytest.approx(expected_lr(3), rel=1e-6)
    assert all(row["lr"] == pytest.approx(expected_lr(row["step"]), rel=1e-6) for row in after)
    assert {row["epoch"] for row in after} == {0}
    ids = [i for row in before + after for i in row["ids"]]
    assert sorted(ids) == list(range(100))  # epoch 0: each training pair once
    assert load(tmp_path / "single" / "run" / "checkpoints" / "last.ckpt")["global_step"] == 3 + len(after)
    assert "resuming a checkpoint of 2 process(es) on 1: weights, optimizer, learning-rate schedule and step 3" in caplog.text
    assert "epoch 0 goes on after the 6 of its" in caplog.text


@pytest.mark.slow  # a 1-process run, then 2 processes that validate: ~40-90 s on 2 cores
def test_one_rank_resumes_on_two(tmp_path):
    """A 1-process run stops at step 5 in epoch 0; resumed on 2 ranks, both go on from step 5 at the
    schedule's learning rate with as many batches each, and the epoch trains every example once,
    and at most one batch twice (the first, repeated to give both ranks as many)."""
    ckpt = on_one_process(tmp_path / "single", ["trainer.max_steps=5", *record(tmp_path / "batches")])
    saved = load(ckpt)
    assert saved["global_step"] == 5 and saved["world_size"] == 1
    _, before = recorded(tmp_path / "batches")
    assert len(before) == 5

    ddp = tmp_path / "ddp"
    text = on_two_processes(tmp_path, ddp, [f"ckpt_path={ckpt}", *record(tmp_path / "ddp_batches")])
    ranks = [recorded(tmp_path / "ddp_batches", rank) for rank in (0, 1)]
    for start, after in ranks:
        assert start == {"start": 5, "train_tokens": round(saved["counters"]["train_tokens"] / 2)}
        assert [row["step"] for row in after] == list(range(5, 5 + len(after)))
        assert all(row["lr"] == pytest.approx(expected_lr(row["step"]), rel=1e-6) for row in after)
        assert {row["epoch"] for row in after} == {0}
    assert len(ranks[0][1]) == len(ranks[1][1])
    after = [row for _, rows in ranks for row in rows]
    counts = Counter(i for row in before + after for i in row["ids"])
    assert set(counts) == set(range(100))
    twice = sorted(i for i, n in counts.items() if n > 1)
    assert twice in ([], sorted(before[0]["ids"]))
    assert load(ddp / "checkpoints" / "last.ckpt")["global_step"] == 5 + len(ranks[0][1])
    assert "resuming a checkpoint of 1 process(es) on 2: weights, optimizer, learning-rate schedule and step 5" in text


@pytest.mark.slow  # two training runs: the slow tier
def test_one_rank_resumed_on_one_ends_with_the_uninterrupted_weights(tmp_path):
    """The same number of processes: bitwise the weights, optimizer and schedule of a run that was
    not stopped (the batches after a resume are the ones each rank had left)."""
    stopped = on_one_process(tmp_path / "stopped", ["trainer.max_steps=5", "trainer.deterministic=true"])
    resumed = on_one_process(tmp_path / "resumed", [f"ckpt_path={stopped}", "trainer.deterministic=true"])
    uninterrupted = on_one_process(tmp_path / "uninterrupted", ["trainer.deterministic=true"])
    assert_same_weights(uninterrupted, resumed)

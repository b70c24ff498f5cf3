"""CpuThreads: the thread count follows the cores other processes leave free, computed from
hand-made /proc samples (busy ticks, total ticks, this process's ticks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import nmt.cpu_threads
from nmt.cpu_threads import CpuThreads, cpu_times, others_busy, threads_for


def test_other_processes_busy_cores_from_two_samples():
    # 2 CPUs, 200 ticks in all: 190 busy, of which this process used 90 -> others 100 ticks = 1 core
    assert others_busy((1000, 5000, 300), (1190, 5200, 390), cpus=2) == pytest.approx(1.0)
    assert others_busy((1000, 5000, 300), (1100, 5200, 400), cpus=2) == 0.0  # all of it ours
    assert others_busy((1000, 5000, 300), (1000, 5000, 300), cpus=2) == 0.0  # no time passed


@pytest.mark.parametrize("others, cpus, most, threads", [(0.0, 2, 2, 2), (0.3, 2, 2, 2), (0.9, 2, 2, 1), (1.8, 2, 2, 1),
                                                         (1.0, 8, 4, 4), (5.2, 8, 8, 3)])
def test_threads_fit_the_cores_left(others, cpus, most, threads):
    assert threads_for(others, cpus, most) == threads


def busy_then_alone(monkeypatch) -> int:
    """Load samples of a 2-core machine: another process keeps one core busy for two looks, then
    leaves; torch starts on two threads. Returns the thread count to restore."""
    samples = iter([(0, 0, 0), (190, 200, 90), (380, 400, 180), (560, 600, 360)])
    monkeypatch.setattr(nmt.cpu_threads, "cpu_times", lambda: next(samples))
    monkeypatch.setattr(nmt.cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1})
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    return before


def test_the_callback_drops_to_one_thread_beside_a_competitor_and_comes_back(monkeypatch):
    before = busy_then_alone(monkeypatch)
    try:
        callback = CpuThreads(every_n_steps=10)
        trainer = SimpleNamespace(world_size=1, global_step=0)
        callback.on_train_start(trainer, SimpleNamespace(device=torch.device("cpu")))
        seen = []
        for step in (5, 10, 20, 30):  # step 5: not a step to look at
            trainer.global_step = step
            callback.on_train_batch_end(trainer, None, None, None, 0)
            seen.append(torch.get_num_threads())
        assert seen == [2, 1, 1, 2]
    finally:
        torch.set_num_threads(before)


def test_proc_samples_are_read_on_linux():
    sample = cpu_times()
    if sample is None:
        pytest.skip("no /proc here")
    busy, total, own = sample
    assert 0 <= busy <= total and own >= 0


def test_test_batches_follow_the_load_and_the_count_comes_back_at_the_end(monkeypatch):
    """A test run (here without training) adapts after every test batch, and teardown gives the
    process its starting count back (a sweep's next run starts from it)."""
    before = busy_then_alone(monkeypatch)
    try:
        callback = CpuThreads()
        trainer = SimpleNamespace(world_size=1, global_step=0)
        callback.on_test_start(trainer, SimpleNamespace(device=torch.device("cpu")))
        seen = []
        for _ in range(2):
            callback.on_test_batch_end(trainer, None, None, None, 0)
            seen.append(torch.get_num_threads())
        assert seen == [1, 1]
        callback.teardown(trainer, None, "test")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

"""CpuThreads: the thread count follows the cores other processes leave free, computed from
hand-made /proc samples (busy ticks, total ticks, this process's ticks), with hysteresis, one log
line for the first change and the time on each thread count in the summary."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import nmt.training.cpu_threads
from nmt.training.cpu_threads import CpuThreads, cpu_times, others_busy, threads_for


def test_other_processes_busy_cores_from_two_samples():
    # 2 CPUs, 200 ticks in all: 190 busy, of which this process used 90 -> others 100 ticks = 1 core
    assert others_busy((1000, 5000, 300), (1190, 5200, 390), cpus=2) == pytest.approx(1.0)
    assert others_busy((1000, 5000, 300), (1100, 5200, 400), cpus=2) == 0.0  # all of it ours
    assert others_busy((1000, 5000, 300), (1000, 5000, 300), cpus=2) == 0.0  # no time passed


@pytest.mark.parametrize("others, cpus, most, current, threads", [
    (0.0, 2, 2, 2, 2), (0.3, 2, 2, 2, 2),
    (0.45, 2, 2, 2, 2),   # less than half a core taken: stay on two
    (0.67, 2, 2, 2, 1),   # a competitor starved to 2/3 of a core by two spinning threads: drop
    (1.8, 2, 2, 2, 1),
    (1.0, 2, 2, 1, 1),    # the competitor holds its core: stay on one
    (0.5, 2, 2, 1, 1),    # half a core busy: not enough free to go back up
    (0.25, 2, 2, 1, 2),   # most of a core free again: back to two
    (1.0, 8, 4, 4, 4), (5.2, 8, 8, 8, 3), (0.0, 8, 8, 3, 8)])
def test_threads_fit_the_cores_left_with_a_dead_band(others, cpus, most, current, threads):
    assert threads_for(others, cpus, most, current) == threads


def load_samples(monkeypatch, others: list[float]) -> int:
    """A 2-core machine where other processes keep ``others[i]`` cores busy between looks i and
    i+1 (100 ticks a core each); this process takes the rest. Looks are due at every call (the
    clock moves a second per call). Returns torch's thread count to restore; torch starts on two."""
    samples, busy, total, own = [(0, 0, 0)], 0, 0, 0
    for o in others:
        busy, total, own = busy + 200, total + 200, own + round(200 - 100 * o)
        samples.append((busy, total, own))
    feed = iter(samples)
    clock = iter(range(0, 10_000))
    monkeypatch.setattr(nmt.training.cpu_threads, "cpu_times", lambda: next(feed))
    monkeypatch.setattr(nmt.training.cpu_threads.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(nmt.training.cpu_threads, "affinity_cores", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    return before


def run_looks(callback: CpuThreads, looks: int) -> list[int]:
    trainer = SimpleNamespace(world_size=1, global_step=0)
    callback.on_train_start(trainer, SimpleNamespace(device=torch.device("cpu")))
    seen = []
    for _ in range(looks):
        callback.on_train_batch_end(trainer, None, None, None, 0)
        seen.append(torch.get_num_threads())
    return seen


def test_the_first_look_drops_to_one_thread_and_a_change_back_needs_two_looks(monkeypatch):
    before = load_samples(monkeypatch, [1.0, 1.0, 0.0, 0.0, 0.0])
    try:
        assert run_looks(CpuThreads(interval_s=0.5, patience=2), 5) == [1, 1, 1, 2, 2]
    finally:
        torch.set_num_threads(before)


def test_a_competitor_that_comes_and_goes_at_every_look_changes_nothing_after_the_first(monkeypatch, caplog):
    """An intermittent competitor: one look busy, one quiet, ... With patience 2 the count settles
    after the first look instead of flipping at every look; one INFO line in all."""
    before = load_samples(monkeypatch, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    try:
        callback = CpuThreads(interval_s=0.5, patience=2)
        with caplog.at_level(logging.DEBUG, logger="nmt.training.cpu_threads"):
            assert run_looks(callback, 8) == [1] * 8
        assert callback.changes == 1
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        assert "running on 1 thread(s) while they do" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_later_changes_are_debug_lines_and_the_summary_holds_seconds_per_thread_count(monkeypatch, caplog):
    before = load_samples(monkeypatch, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    try:
        callback = CpuThreads(interval_s=0.5, patience=2)
        with caplog.at_level(logging.DEBUG, logger="nmt.training.cpu_threads"):
            seen = run_looks(callback, 7)
            callback.on_fit_end(None, None)
        assert seen == [1, 1, 2, 2, 1, 1, 2]
        assert callback.changes == 4
        levels = [r.levelno for r in caplog.records]
        assert levels.count(logging.INFO) == 2 and levels.count(logging.DEBUG) == 3  # first change + the end's shares
        # clock: start 0, looks at 1..7 (one tick per call: the time check and the look each read it)
        summary = callback.summary()
        assert summary["changes"] == 4 and summary["started_with"] == 2
        assert set(summary["seconds_by_threads"]) == {"1", "2"}
        assert sum(summary["seconds_by_threads"].values()) == pytest.approx(callback.changed_at - 0.0)
        assert "cpu_threads: " in caplog.records[-1].getMessage() and "4 change(s)" in caplog.records[-1].getMessage()
    finally:
        torch.set_num_threads(before)


def test_no_look_before_the_interval(monkeypatch):
    before = load_samples(monkeypatch, [1.0])
    ticks = iter([0.0, 0.1, 0.2, 0.6, 0.7, 0.8])
    monkeypatch.setattr(nmt.training.cpu_threads.time, "monotonic", lambda: next(ticks))
    try:
        callback = CpuThreads(interval_s=0.5)
        assert run_looks(callback, 3) == [2, 2, 1]  # looks at 0.1, 0.2 skipped; at 0.6 the load is read
        assert callback.looks == 1
    finally:
        torch.set_num_threads(before)


def test_proc_samples_are_read_on_linux():
    first = cpu_times()
    if first is None:
        pytest.skip("no /proc here")
    sum(i * i for i in range(2_000_000))  # this process's own work between the samples
    second = cpu_times()
    busy, total, own = (b - a for a, b in zip(first, second))
    assert own > 0, "this process's ticks did not move while it computed"
    assert busy >= own * 0.5 and total >= busy  # the machine's busy ticks hold this process's


def test_test_batches_follow_the_load_and_the_count_comes_back_at_the_end(monkeypatch):
    """A test run (here without training) adapts after test batches, and teardown gives the
    process its starting count back (a sweep's next run starts from it)."""
    before = load_samples(monkeypatch, [1.0, 1.0])
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


@pytest.mark.parametrize("kwargs, message", [
    ({"interval_s": 0}, "callbacks.cpu_threads.interval_s=0: a positive number of seconds"),
    ({"interval_s": float("nan")}, "callbacks.cpu_threads.interval_s=nan: a positive number of seconds"),
    ({"patience": 0}, "callbacks.cpu_threads.patience=0: a whole number of looks, at least 1"),
    ({"patience": 1.5}, "callbacks.cpu_threads.patience=1.5: a whole number of looks, at least 1"),
    ({"interval_s": "0.5s"}, "callbacks.cpu_threads.interval_s='0.5s': a positive number of seconds"),
])
def test_bad_settings_are_refused_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        CpuThreads(**kwargs)

"""Learning-rate schedules: the warm-up cosine's shape, and its horizon set by the run's budget
(``ScheduleHorizon``: max_time at the pace so far, or max_epochs), saved in checkpoints."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from pytorch_lightning.callbacks import Timer

import nmt.training.callbacks
from nmt.training.callbacks import ScheduleHorizon
from nmt.checkpoints.files import read_checkpoint
from nmt.training.schedules import WarmupCosine, inverse_sqrt
from nmt.train import train


def optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def factors(schedule, steps: int) -> list[float]:
    return [schedule.lr_lambdas[0](step) for step in range(steps)]


def test_warmup_cosine_warms_up_then_decays_to_its_floor():
    schedule = WarmupCosine(optimizer(), warmup_steps=10, total_steps=110, min_ratio=0.1)
    f = factors(schedule, 200)
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f[10] == pytest.approx(1.0) and f[60] == pytest.approx(0.55)  # half way down: (1 + 0.1) / 2
    assert f[110:] == pytest.approx([0.1] * 90)  # the floor from total_steps on
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    # max_steps=-1 (the config's total_steps): no horizon yet, the peak is held after the warm-up
    held = WarmupCosine(optimizer(), warmup_steps=10, total_steps=-1)
    assert held.from_budget and factors(held, 30)[10:] == [1.0] * 20


def test_inverse_sqrt_peaks_at_the_end_of_the_warmup():
    f = factors(inverse_sqrt(optimizer(), warmup_steps=100), 400)
    assert max(f) == f[99] == 1.0 and f[399] == pytest.approx(math.sqrt(100 / 400))


def test_a_resumed_schedule_decays_to_its_own_configs_end():
    """The horizon is not read back from a checkpoint: a run resumed with a longer max_steps decays
    to the new end (a budget horizon is re-estimated)."""
    schedule = WarmupCosine(optimizer(), warmup_steps=10, total_steps=100)
    for _ in range(50):
        schedule.optimizer.step()
        schedule.step()
    longer = WarmupCosine(optimizer(), warmup_steps=10, total_steps=200)
    longer.load_state_dict(schedule.state_dict())
    assert longer.last_epoch == 50 and longer.total_steps == 200
    assert longer.factor(105) == pytest.approx(0.5)  # half way from 10 to 200


def fake_trainer(schedule, *, remaining: float | None, spent: float = 0.0, max_epochs: int = -1, batches: int = 50,
                 step: int = 0):
    callbacks = []
    if remaining is not None:
        timer = Timer(duration="00:00:10:00")
        timer.time_remaining = lambda stage="train": remaining
        timer.time_elapsed = lambda stage="train": spent
        callbacks.append(timer)
    return SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=schedule)], callbacks=callbacks,
                           max_steps=-1, max_epochs=max_epochs, num_training_batches=batches,
                           accumulate_grad_batches=1, global_step=step,
                           strategy=SimpleNamespace(broadcast=lambda obj, src=0: obj))


def test_the_horizon_is_where_max_time_runs_out_at_the_pace_so_far(monkeypatch):
    clock = [1000.0]  # the callback's clock, moved by hand: nothing here waits or reads real time
    monkeypatch.setattr(nmt.training.callbacks, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    schedule = WarmupCosine(optimizer(), warmup_steps=10, total_steps=None)
    trainer = fake_trainer(schedule, remaining=30.0, max_epochs=100)  # 100 epochs: 5,000 steps
    horizon = ScheduleHorizon(every_n_steps=10)
    horizon.on_train_start(trainer, None)
    assert schedule.total_steps is None  # no pace yet
    clock[0] += 10.0  # 100 steps in 10 s, 30 s left: 300 more steps
    trainer.global_step = 100
    horizon.on_train_batch_end(trainer, None, None, None, 0)
    assert schedule.total_steps == 400
    trainer.max_epochs = 6  # the epochs end first: 300 steps
    trainer.global_step = 110
    horizon.on_train_batch_end(trainer, None, None, None, 0)
    assert schedule.total_steps == 300
    # Resumed at step 200 after 40 s of the budget, 20 s left: from the start, 100 more steps.
    resumed = WarmupCosine(optimizer(), warmup_steps=10, total_steps=None)
    ScheduleHorizon().on_train_start(fake_trainer(resumed, remaining=20.0, spent=40.0, max_epochs=100, step=200), None)
    assert resumed.total_steps == 300


def test_without_a_budget_the_decay_has_no_end_and_training_does_not_start():
    schedule = WarmupCosine(optimizer(), warmup_steps=10, total_steps=None)
    with pytest.raises(ValueError, match=r"^scheduler.total_steps is not set and the run has no trainer.max_steps, "
                                         r"max_epochs or max_time for the learning-rate decay to end at: set one"):
        ScheduleHorizon().on_train_start(fake_trainer(schedule, remaining=None, max_epochs=-1), None)
    fixed = WarmupCosine(optimizer(), warmup_steps=10, total_steps=100)  # a fixed horizon is left alone
    ScheduleHorizon().on_train_start(fake_trainer(fixed, remaining=None, max_epochs=-1), None)
    assert fixed.total_steps == 100


def test_a_run_with_max_epochs_ends_its_decay_at_the_last_step(cfg_train):
    """callbacks.schedule_horizon (in callbacks/default.yaml) ends the decay; without it the run
    does not start (tests/test_builders.py)."""
    cfg = cfg_train(["scheduler=cosine", "scheduler.warmup_steps=2", "scheduler.min_ratio=0.1", "trainer.max_epochs=2",
                     "test=false"], model="lstm")
    train(cfg)
    state = read_checkpoint(f"{cfg.paths.output_dir}/checkpoints/last.ckpt")
    assert state["global_step"] == 10  # 2 epochs of 5 batches
    assert state["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.1 * cfg.optimizer.lr)

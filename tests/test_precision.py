"""``trainer.precision=auto``, the default: bf16 autocast where the hardware computes in bf16, logged."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import nmt
from nmt.machine import resolve_precision
from nmt.train import train
from tests.conftest import CONF_DIR


@pytest.mark.parametrize("bf16, expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_auto_on_a_cpu_follows_its_bf16_instructions(cfg_train, monkeypatch, caplog, bf16, expected):
    monkeypatch.setattr(nmt, "cpu_has_bf16", lambda: bf16)
    cfg = cfg_train(["trainer.precision=auto"])
    with caplog.at_level(logging.INFO, logger="nmt.machine"):
        resolve_precision(cfg)
    assert cfg.trainer.precision == expected
    assert f"trainer.precision=auto: {expected} (" in caplog.text


@pytest.mark.parametrize("bf16, expected", [(True, "bf16-mixed"), (False, "16-mixed")])
def test_auto_on_a_gpu_uses_bf16_or_loss_scaled_fp16(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    assert nmt.auto_precision("cuda")[0] == expected


def test_an_explicit_precision_is_kept(cfg_train, monkeypatch):
    monkeypatch.setattr(nmt, "cpu_has_bf16", lambda: True)
    cfg = cfg_train(["trainer.precision=32-true"])
    resolve_precision(cfg)
    assert cfg.trainer.precision == "32-true"


def test_every_trainer_config_defaults_to_auto():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for trainer in ("default", "cpu", "gpu", "ddp"):
            assert compose("train", overrides=[f"trainer={trainer}"]).trainer.precision == "auto", trainer
    GlobalHydra.instance().clear()


def test_a_run_records_the_precision_auto_chose(cfg_train, tmp_path):
    cfg = cfg_train(["trainer.precision=auto", "test=false", "trainer.max_steps=2"])
    train(cfg)
    chosen = nmt.auto_precision("cpu")[0]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["hardware"]["precision"] == chosen
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["run_config"]["trainer"]["precision"] == chosen

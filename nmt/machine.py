"""What the machine a run trains on is: its training device, its CPU's name, and the precision
``trainer.precision=auto`` picks for it."""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from nmt import auto_precision

log = logging.getLogger(__name__)


def training_device(cfg: DictConfig) -> str:
    """``cpu`` or ``cuda``: where ``cfg.trainer`` trains."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator in ("gpu", "cuda") else accelerator


def resolve_precision(cfg: DictConfig) -> None:
    """``trainer.precision=auto`` becomes what ``nmt.auto_precision`` picks for the training device; logged."""
    if str(cfg.trainer.get("precision")) != "auto":
        return
    precision, why = auto_precision(training_device(cfg))
    with open_dict(cfg):
        cfg.trainer.precision = precision
    log.info("trainer.precision=auto: %s (%s; trainer.precision=32-true trains in fp32)", precision, why)


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name, with its family and model number where Linux gives them (one
    name, e.g. ``AMD EPYC``, covers several generations whose speeds differ)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name

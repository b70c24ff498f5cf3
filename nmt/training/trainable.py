"""What a run trains of its model: parts frozen (``module.freeze``) and low-rank adapters
(``module.lora``, ``nmt.models.lora``), for fine-tuning a model too large to train whole.

A frozen parameter keeps ``requires_grad=False``: no gradient is computed for it and the optimizer
is never given it (``TranslationModule.configure_optimizers``), so it holds no Adam moments either.
With adapters, every weight of the model is frozen and only the adapters train (Hu et al. 2021).
A weight shared between parts (tied or shared embeddings) is one tensor: freezing either part
freezes it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from nmt.models.lora import LoRASettings, add_adapters

log = logging.getLogger(__name__)

# embeddings: the tables the vocabulary and positions are read from and the output layer that writes
# the vocabulary (weight and logits bias); encoder, decoder: every weight of the part, its embeddings included.
PARTS = ("embeddings", "encoder", "decoder")


def check_freeze(freeze: Sequence[str] | None, key: str = "module.freeze") -> tuple[str, ...]:
    """The parts of ``freeze`` (``PARTS``), or a one-line ValueError naming ``key``."""
    if freeze is None:
        return ()
    if isinstance(freeze, str) or not isinstance(freeze, Sequence) or any(part not in PARTS for part in freeze):
        raise ValueError(f"{key}={str(freeze)[:80]}: a list of {', '.join(PARTS)} (e.g. [embeddings, encoder]), or []")
    return tuple(dict.fromkeys(str(part) for part in freeze))


def part_modules(model: nn.Module, part: str) -> list[nn.Module]:
    """The modules of a Seq2Seq's ``part`` (``PARTS``)."""
    if part != "embeddings":
        return [getattr(model, part)]
    tables = [getattr(side, "embed_tokens", None) or side.embed for side in (model.encoder, model.decoder)]
    return [*tables, model.decoder.out]


def prepare(model: nn.Module, freeze: Sequence[str] | None = None,
            lora: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Add ``lora``'s adapters to ``model`` (then only they train), and freeze the ``freeze`` parts;
    in place. The parameters trained and frozen, and the adapters added; a one-line ValueError
    names the key of a setting that cannot apply."""
    parts = check_freeze(freeze)
    settings = LoRASettings.from_config(lora)
    adapters = 0
    if settings is not None:
        base = list(model.parameters())
        adapters = add_adapters(model, settings)
        for p in base:
            p.requires_grad_(False)
    for part in parts:
        for module in part_modules(model, part):
            for p in module.parameters():
                p.requires_grad_(False)
    params = list(model.parameters())  # a shared weight once
    trained = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    if not trained:
        raise ValueError(f"module.freeze={list(parts)}: nothing of the model is left to train")
    if parts or settings is not None:
        log.info("training %s of %s parameters (%.2f%%)%s%s", f"{trained:,}", f"{trained + frozen:,}",
                 100 * trained / (trained + frozen), f"; frozen: {', '.join(parts)}" if parts else "",
                 f"; {adapters} LoRA adapters of rank {settings.rank} ({', '.join(settings.targets)}), every other "
                 "weight frozen" if settings else "")
    return {"trained": trained, "frozen": frozen, "adapters": adapters}


def trained_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer is given: those that require a gradient, each once, in order."""
    return [p for p in model.parameters() if p.requires_grad]

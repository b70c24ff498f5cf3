"""Low-rank adapters (LoRA, Hu et al. 2021) on a Transformer's attention projections.

A pretrained weight ``W0`` (out, in) stays frozen; the update is a product of two small matrices,
``B`` (out, r) and ``A`` (r, in), scaled by ``alpha / r`` (Hu et al. 2021, eq. 3 and sec. 4.1):

    h = W0 x + (alpha / r) B A x

``A`` is drawn at random, ``B`` is zero, so a model with fresh adapters computes exactly what the
model computed before them. Dropout, when set, applies to the adapters' input only. After
training, ``W = W0 + (alpha / r) B A`` is an ordinary weight (``merged_state``): a merged model
is the plain Transformer again, and decodes at the plain model's cost.

The targets are the query, key, value and output projections of every attention
(``q``, ``k``, ``v``, ``out``), or of one kind of attention (``encoder.q``: encoder
self-attention, ``decoder.q``: decoder self-attention, ``cross.q``: the decoder's attention over
the source; ``nmt.models.head_mask.KINDS``). Our keys and values share one projection
(``kv_proj``: keys in its first half of rows, values in its second), so ``k`` and ``v`` are each an
adapter of their half, as two separate maps would have.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.models.dropout import Dropout
from nmt.models.head_mask import KINDS, attentions

# A target: the projection that holds it, its block of that projection's rows and how many blocks.
PARTS = {"q": ("q_proj", 0, 1), "k": ("kv_proj", 0, 2), "v": ("kv_proj", 1, 2), "out": ("out_proj", 0, 1)}
TARGETS = (*PARTS, *(f"{kind}.{part}" for kind in KINDS for part in PARTS))
MAX_RANK = 1024  # an adapter of higher rank is no longer low-rank for any model nmt trains
ADAPTER = re.compile(r"(?P<linear>.+)\.lora_(?P<matrix>[AB])\.(?P<part>q|k|v|out)")  # an adapter's state-dict name


@dataclass(frozen=True)
class LoRASettings:
    """Checked LoRA settings: rank r, alpha (the update is scaled by alpha / r), dropout on the
    adapters' input, and the targets (``TARGETS``)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, key: str = "module.lora") -> LoRASettings | None:
        """The settings of a ``lora`` config (rank, alpha, dropout, targets), None for no adapters
        (rank 0 or null, or no config); a one-line ValueError naming ``key`` otherwise."""
        if config is None:
            return None
        if not isinstance(config, Mapping):
            raise ValueError(f"{key}: a mapping of rank, alpha, dropout and targets, not {str(config)[:60]}")
        unknown = sorted(str(k) for k in config if k not in ("rank", "alpha", "dropout", "targets"))
        if unknown:
            raise ValueError(f"{key}.{unknown[0][:40]}: not a LoRA setting (rank, alpha, dropout, targets)")
        rank = config.get("rank")
        if rank is None or rank == 0 and not isinstance(rank, bool):
            return None
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
            raise ValueError(f"{key}.rank={str(rank)[:40]}: a whole number from 1 to {MAX_RANK} (0 or null: no adapters)")
        alpha = rank if config.get("alpha") is None else config["alpha"]  # null: the scale alpha / rank is 1
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"{key}.alpha={str(alpha)[:40]}: a number above 0 (the update is scaled by alpha / rank)")
        dropout = config.get("dropout", 0.0)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"{key}.dropout={str(dropout)[:40]}: a probability from 0 to below 1")
        targets = config.get("targets", ("q", "v"))
        if isinstance(targets, str) or not isinstance(targets, Sequence) or not targets \
                or len(targets) > len(TARGETS) or any(t not in TARGETS for t in targets):
            raise ValueError(f"{key}.targets={str(targets)[:80]}: a list of {', '.join(PARTS)} (every attention) "
                             f"or <kind>.<part> with kind {', '.join(KINDS)} (e.g. cross.v)")
        return cls(rank, float(alpha), float(dropout), tuple(str(t) for t in targets))


class LoRALinear(nn.Module):
    """An ``nn.Linear`` with adapters on blocks of its output rows: the linear's own ``weight`` and
    ``bias`` (the same parameters, so their names in the state dict stay), and for each adapted
    ``part`` ``lora_A[part]`` (r, in) and ``lora_B[part]`` (rows, r). x (..., in) -> (..., out)."""

    def __init__(self, linear: nn.Linear, rank: int, scale: float, dropout: float, blocks: int,
                 parts: Mapping[str, int]) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rank, self.scale, self.blocks = rank, scale, blocks
        self.parts = dict(sorted(parts.items(), key=lambda item: item[1]))  # part -> its block, in row order
        rows = self.out_features // blocks
        like = {"device": self.weight.device, "dtype": self.weight.dtype}
        self.lora_A = nn.ParameterDict({part: nn.Parameter(torch.empty(rank, self.in_features, **like))
                                        for part in self.parts})
        self.lora_B = nn.ParameterDict({part: nn.Parameter(torch.zeros(rows, rank, **like)) for part in self.parts})
        for a in self.lora_A.values():  # "a random Gaussian initialization for A and zero for B" (sec. 4.1)
            nn.init.normal_(a, std=self.in_features ** -0.5)
        self.drop = Dropout(dropout)

    def delta(self, x: Tensor) -> Tensor:
        """(alpha / r) B A x for every block of rows (zero where a block has no adapter): (..., out)."""
        x = self.drop(x)
        updates = {part: F.linear(F.linear(x, self.lora_A[part]), self.lora_B[part]) for part in self.parts}
        if len(updates) == self.blocks:
            update = torch.cat(list(updates.values()), dim=-1) if self.blocks > 1 else updates[next(iter(updates))]
        else:
            zero = x.new_zeros(*x.shape[:-1], self.out_features // self.blocks)
            block = {index: part for part, index in self.parts.items()}
            update = torch.cat([updates[block[i]] if i in block else zero for i in range(self.blocks)], dim=-1)
        return update * self.scale

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + self.delta(x)

    def merged_weight(self) -> Tensor:
        """W0 + (alpha / r) B A, block by block: (out, in)."""
        return merged_weight(self.weight, {part: (self.lora_A[part], self.lora_B[part]) for part in self.parts},
                             self.blocks, self.scale, self.parts)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, parts={list(self.parts)}"


def merged_weight(weight: Tensor, adapters: Mapping[str, tuple[Tensor, Tensor]], blocks: int, scale: float,
                  parts: Mapping[str, int]) -> Tensor:
    """``weight`` (out, in) + scale * B A on each adapted block of rows; ``adapters``: part -> (A, B)."""
    merged = weight.detach().clone()
    rows = weight.size(0) // blocks
    with torch.no_grad():
        for part, (a, b) in adapters.items():
            start = parts[part] * rows
            merged[start : start + rows] += scale * (b.to(merged.dtype) @ a.to(merged.dtype))
    return merged


def add_adapters(model: nn.Module, settings: LoRASettings) -> int:
    """Replace the targeted projections of ``model``'s Transformer attentions (a Seq2Seq) with
    ``LoRALinear``s, in place; the number of adapters added. A model without Transformer attention,
    or with adapters already, is a one-line ValueError."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("module.lora: the model has adapters already")
    try:
        found = attentions(model)
    except ValueError as e:
        raise ValueError(f"module.lora: adapters go on Transformer attention; {e}") from None
    added = 0
    for kind, layers in found.items():
        chosen = [t.split(".")[-1] for t in settings.targets if t in PARTS or t.startswith(f"{kind}.")]
        by_linear: dict[str, dict[str, int]] = {}
        for part in dict.fromkeys(chosen):
            name, block, _ = PARTS[part]
            by_linear.setdefault(name, {})[part] = block
        for attention in layers:
            for name, parts in by_linear.items():
                linear = getattr(attention, name)
                setattr(attention, name, LoRALinear(linear, settings.rank, settings.scale, settings.dropout,
                                                    PARTS[next(iter(parts))][2], parts))
                getattr(attention, name).drop.kernels = getattr(model, "kernels", attention.kernels)
                added += len(parts)
    if not added:
        raise ValueError(f"module.lora.targets={list(settings.targets)}: none of the model's attentions "
                         f"({', '.join(found)}) is targeted")
    return added


def merge_adapters(model: nn.Module) -> nn.Module:
    """Every ``LoRALinear`` of ``model`` replaced by the ``nn.Linear`` of its merged weight, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device=child.weight.device, dtype=child.weight.dtype)
                with torch.no_grad():
                    linear.weight.copy_(child.merged_weight())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                linear.weight.requires_grad_(child.weight.requires_grad)
                if child.bias is not None:
                    linear.bias.requires_grad_(child.bias.requires_grad)
                setattr(parent, name, linear)
    return model


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is an adapter's (``...q_proj.lora_A.q``)."""
    return ADAPTER.fullmatch(name) is not None


def merged_state(state: Mapping[str, Tensor], scale: float, rank: int) -> dict[str, Tensor]:
    """A state dict with adapters (``LoRALinear``'s names) as the plain model's: each adapted
    weight ``W0 + scale * B A``, the adapters left out. Every adapter's base weight, pair and
    shapes are checked first: a one-line ValueError names the first that does not fit."""
    adapters: dict[str, dict[str, dict[str, Tensor]]] = {}
    for name, tensor in state.items():
        found = ADAPTER.fullmatch(name)
        if found:
            adapters.setdefault(found["linear"], {}).setdefault(found["part"], {})[found["matrix"]] = tensor
    merged = {name: tensor for name, tensor in state.items() if not is_adapter(name)}
    for linear, parts in adapters.items():
        weight = state.get(f"{linear}.weight")
        projection = linear.rsplit(".", 1)[-1]
        if weight is None or weight.dim() != 2 or any(PARTS[p][0] != projection for p in parts):
            raise ValueError(f"{linear}.lora_*: adapters of {projection}, which holds no "
                             f"{'/'.join(parts)} projection weight")
        blocks = PARTS[next(iter(parts))][2]
        rows = weight.size(0) // blocks
        for part, pair in parts.items():
            a, b = pair.get("A"), pair.get("B")
            if a is None or b is None or tuple(a.shape) != (rank, weight.size(1)) or tuple(b.shape) != (rows, rank):
                shapes = ", ".join(f"{m} {tuple(t.shape)}" for m, t in sorted(pair.items()))
                raise ValueError(f"{linear}.lora_*.{part}: {shapes or 'none'}; the adapter of rank {rank} of a "
                                 f"{tuple(weight.shape)} weight is A {(rank, weight.size(1))} and B {(rows, rank)}")
        merged[f"{linear}.weight"] = merged_weight(
            weight, {part: (pair["A"], pair["B"]) for part, pair in parts.items()}, blocks, scale,
            {part: PARTS[part][1] for part in parts})
    return merged

"""Guided alignment (Garg et al. 2019): a loss that pulls a Transformer decoder's cross-attention
toward word alignments, so that the alignments read from it (``nmt.inference.alignments``) are
good ones.

Each target subword t linked to source subwords A_t (``data.alignments``, lifted to subwords by
``nmt.data.alignments``) gets the alignment distribution p_t(s) = 1/|A_t| on A_t, and the loss is
the cross-entropy -sum_s p_t(s) log a_t(s) with the attention a_t of one head (or of a layer's
heads averaged), averaged over the linked target subwords; unlinked ones are skipped. Its
minimum over a_t is at a_t = p_t, where the gradient with respect to the attention's scores,
a_t - p_t, is zero. ``module.guided_alignment`` sets ``weight`` (0: off), ``layer`` and ``head``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

EPS = 1e-9  # attention weights below this count as this in the log (masked source positions are 0)


@dataclass(frozen=True)
class GuidedAlignment:
    """weight: the alignment loss's weight beside the translation loss (0: off); layer: the decoder
    layer whose cross-attention is guided (from 0; -1: the last); head: a head of that layer (from
    0), or "mean": the average of its heads (what ``Seq2Seq.alignment_attention`` reads)."""

    weight: float = 0.0
    layer: int = -1
    head: int | str = "mean"

    @classmethod
    def from_config(cls, config: dict | None) -> GuidedAlignment:
        config = dict(config or {})
        unknown = sorted(set(config) - {"weight", "layer", "head"})
        if unknown:
            raise ValueError(f"module.guided_alignment.{unknown[0]}: not an option (weight, layer, head)")
        made = cls(**config)
        if isinstance(made.weight, bool) or not isinstance(made.weight, (int, float)) or not made.weight >= 0:
            raise ValueError(f"module.guided_alignment.weight={made.weight!r}: a number >= 0 (0: off)")
        if isinstance(made.layer, bool) or not isinstance(made.layer, int):
            raise ValueError(f"module.guided_alignment.layer={made.layer!r}: a decoder layer index (from 0; -1: the last)")
        if made.head != "mean" and (isinstance(made.head, bool) or not isinstance(made.head, int) or made.head < 0):
            raise ValueError(f"module.guided_alignment.head={made.head!r}: a head index from 0, or mean")
        return made

    def check_model(self, model: torch.nn.Module) -> None:
        """A one-line ValueError unless ``model``'s decoder has this layer and head of multi-head
        cross-attention."""
        decoder = model.decoder
        if not hasattr(decoder, "features_with_attention"):
            kind = "an RNN decoder" if getattr(decoder, "attention", None) is not None else "a decoder without attention"
            raise ValueError(f"module.guided_alignment.weight={self.weight}: guided alignment trains a Transformer "
                             f"decoder's cross-attention; model.decoder is {kind} ({type(decoder).__name__})")
        self._check_sizes(len(decoder.layers), decoder.num_heads)

    def check_run(self, alignments: str | None, decoder: str, layers: int | None, heads: int | None) -> None:
        """Before any data is prepared: a one-line ValueError for a run that cannot guide ``decoder``
        (its class path, with its ``layers`` and ``heads`` where known) with ``alignments``
        (``data.alignments``)."""
        if not self.weight:
            return
        if not decoder.endswith("TransformerDecoder"):
            raise ValueError(f"module.guided_alignment.weight={self.weight}: guided alignment trains a Transformer "
                             f"decoder's cross-attention; model.decoder is {decoder.rsplit('.', 1)[-1]}")
        if alignments is None:
            raise ValueError(f"module.guided_alignment.weight={self.weight} needs word alignments of the training pairs: "
                             "set data.alignments to a Pharaoh file or eflomal")
        self._check_sizes(layers, heads)

    def _check_sizes(self, layers: int | None, heads: int | None) -> None:
        if layers is not None and not -layers <= self.layer < layers:
            raise ValueError(f"module.guided_alignment.layer={self.layer}: the decoder has {layers} layers "
                             f"({-layers} to {layers - 1})")
        if heads is not None and self.head != "mean" and self.head >= heads:
            raise ValueError(f"module.guided_alignment.head={self.head}: the decoder has {heads} heads (0 to {heads - 1}), "
                             "or mean")

    def attention(self, weights: Tensor) -> Tensor:
        """The guided attention (B, T, S) of one layer's weights (B, heads, T, S)."""
        return weights.mean(1) if self.head == "mean" else weights[:, self.head]


def alignment_targets(links: Tensor, shape: tuple[int, int, int]) -> Tensor:
    """The alignment distributions (B, T, S) of ``links`` (L, 3): (row, target position, source
    position); a linked target position's row sums to 1, an unlinked one's is 0."""
    p = torch.zeros(shape, device=links.device)
    p[links[:, 0], links[:, 1], links[:, 2]] = 1.0
    return p / p.sum(-1, keepdim=True).clamp(min=1.0)


def guided_alignment_loss(attn: Tensor, links: Tensor) -> Tensor:
    """Cross-entropy of the attention ``attn`` (B, T, S) with the alignment distributions of
    ``links`` (L, 3), averaged over the linked target positions (0 with no link)."""
    p = alignment_targets(links, tuple(attn.shape))
    linked = (p.sum(-1) > 0).sum()  # no host sync: an unlinked position's cross-entropy is 0
    ce = -(p * attn.float().clamp(min=EPS).log()).sum(-1)  # (B, T)
    return ce.sum() / linked.clamp(min=1)


def check_guided_alignment(cfg: Any) -> None:
    """``GuidedAlignment.check_run`` on a run config (``module.guided_alignment``, ``data.alignments``,
    ``model.decoder``), before the data are prepared."""
    guided = GuidedAlignment.from_config(cfg.module.get("guided_alignment"))
    decoder = cfg.model.get("decoder") or {}
    guided.check_run(cfg.data.get("alignments"), str(decoder.get("_target_", "")), decoder.get("num_layers"),
                     decoder.get("num_heads"))

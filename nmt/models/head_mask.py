"""A Transformer's attention heads by kind, masked or pruned (Michel et al. 2019).

Three kinds: ``encoder`` (encoder self-attention), ``decoder`` (decoder self-attention) and
``cross`` (the decoder's attention over the source). ``set_head_mask`` gives every attention a mask
(heads,) that multiplies each head's output before the output projection: 1 keeps a head, 0
removes it, and a mask that requires grad is the variable whose gradient measures a head's
importance (``nmt.evaluation.heads.importance``). Every path honours it: teacher forcing, the
incremental decoding steps with their key/value cache, and the fixed-shape engine
(``nmt.decoding.fixed_beam``), since all of them go through ``MultiHeadAttention.merge``.
``prune`` removes heads from the weights themselves (``MultiHeadAttention.keep_heads``): a model
with fewer heads in some layers, whose config carries them per layer (``pruned_config``:
``self_heads`` of the encoder and decoder, ``cross_heads`` of the decoder).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from nmt.models.transformer import MultiHeadAttention, TransformerDecoder, TransformerEncoder

KINDS = ("encoder", "decoder", "cross")


def attentions(model: nn.Module) -> dict[str, list[MultiHeadAttention]]:
    """Each kind's attention modules, layer by layer, of a Seq2Seq's Transformer parts (a hybrid
    has the kinds of its Transformer side); a one-line ValueError for a model with none."""
    found: dict[str, list[MultiHeadAttention]] = {}
    if isinstance(model.encoder, TransformerEncoder):
        found["encoder"] = [layer.self_attn for layer in model.encoder.layers]
    if isinstance(model.decoder, TransformerDecoder):
        found["decoder"] = [layer.self_attn for layer in model.decoder.layers]
        found["cross"] = [layer.cross_attn for layer in model.decoder.layers]
    if not found:
        raise ValueError(f"a {type(model.encoder).__name__} and a {type(model.decoder).__name__}: no attention heads "
                         "(heads are a Transformer's)")
    return found


def head_counts(model: nn.Module) -> dict[str, list[int]]:
    """Each kind's head count per layer."""
    return {kind: [a.num_heads for a in layers] for kind, layers in attentions(model).items()}


def set_head_mask(model: nn.Module, masks: Mapping[str, Sequence[Tensor]] | None) -> None:
    """Give each kind's layers their masks (heads,) (a kind left out keeps every head); None
    clears every mask. A mask of the wrong size is a one-line ValueError."""
    found = attentions(model)
    for kind, layers in found.items():
        for i, attention in enumerate(layers):
            mask = None if masks is None or kind not in masks else masks[kind][i]
            if mask is not None and tuple(mask.shape) != (attention.num_heads,):
                raise ValueError(f"head mask of {kind} layer {i}: shape {tuple(mask.shape)}, the layer has "
                                 f"{attention.num_heads} heads")
            attention.head_mask = mask
    unknown = set(masks or {}) - set(found)
    if unknown:
        raise ValueError(f"head masks for {sorted(unknown)}: the model's kinds are {sorted(found)}")


def ones_mask(model: nn.Module, requires_grad: bool = False) -> dict[str, list[Tensor]]:
    """A mask of ones for every head (on the model's device): each head kept."""
    device = next(model.parameters()).device
    return {kind: [torch.ones(a.num_heads, device=device, requires_grad=requires_grad) for a in layers]
            for kind, layers in attentions(model).items()}


def prune(model: nn.Module, keep: Mapping[str, Sequence[Sequence[int]]]) -> None:
    """Keep ``keep[kind][layer]``'s heads (increasing indices, at least one) of each kind's layers
    and drop the others' weights; a kind left out keeps every head. Masks set on the model are
    pruned with their heads."""
    found = attentions(model)
    for kind, layers in keep.items():
        if kind not in found:
            raise ValueError(f"heads to keep for {kind!r}: the model's kinds are {sorted(found)}")
        for attention, heads in zip(found[kind], layers, strict=True):
            if list(heads) != list(range(attention.num_heads)):
                attention.keep_heads([int(h) for h in heads])


def pruned_config(model_config: Mapping[str, Any], counts: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """``model_config`` (a Seq2Seq config, as a checkpoint stores it) with the head counts per
    layer of a pruned model (``head_counts``): ``encoder.self_heads``, ``decoder.self_heads`` and
    ``decoder.cross_heads``."""
    config = {**model_config}
    keys = {"encoder": ("encoder", "self_heads"), "decoder": ("decoder", "self_heads"), "cross": ("decoder", "cross_heads")}
    for kind, per_layer in counts.items():
        part, key = keys[kind]
        config[part] = {**config[part], key: [int(n) for n in per_layer]}
    return config


def least_important(scores: Mapping[str, Sequence[Tensor]], share: float) -> dict[str, list[list[int]]]:
    """The heads to keep, per kind and layer, when the ``share`` of all heads with the lowest
    ``scores`` (each layer's (heads,), e.g. ``nmt.evaluation.heads.importance``) are pruned, ranked
    across layers and kinds as Michel et al. (2019) do; every attention keeps at least one head
    (its next-weakest is then kept and a weaker one elsewhere pruned), ties go to the earlier kind,
    layer and head."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"a pruning level of {share}: a share of the heads from 0 up to (not including) 1")
    ranked = sorted((float(s), KINDS.index(kind), layer, head) for kind, layers in scores.items()
                    for layer, values in enumerate(layers) for head, s in enumerate(values.tolist()))
    left = {(KINDS.index(kind), layer): len(values) for kind, layers in scores.items() for layer, values in enumerate(layers)}
    goal, dropped = round(share * len(ranked)), set()
    for _, kind, layer, head in ranked:
        if len(dropped) == goal:
            break
        if left[(kind, layer)] > 1:
            left[(kind, layer)] -= 1
            dropped.add((kind, layer, head))
    return {kind: [[h for h in range(len(values)) if (KINDS.index(kind), layer, h) not in dropped]
                   for layer, values in enumerate(layers)] for kind, layers in scores.items()}


def pruned_keys(model: nn.Module) -> list[str]:
    """The config keys of a pruned model's head counts (``encoder.self_heads``, ...) where some
    layer has fewer heads than its width holds (empty: not pruned): what formats with the same
    heads in every layer (CTranslate2, Hugging Face) cannot express."""
    keys = {"encoder": "model.encoder.self_heads", "decoder": "model.decoder.self_heads", "cross": "model.decoder.cross_heads"}
    try:
        found = attentions(model)
    except (AttributeError, ValueError):
        return []
    return [keys[kind] for kind, layers in found.items()
            if any(a.num_heads * a.head_size != a.out_proj.out_features for a in layers)]

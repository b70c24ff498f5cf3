"""LSTM kernels for CPUs, on ``nn.LSTM``'s own parameters (so checkpoints are the same):

- ``encoder_layer``: one layer of a (bidirectional) encoder stepped through time, both
  directions in one batched matmul per step, a sentence's state advancing only on its own
  tokens. It computes what ``nn.LSTM`` computes on packed sequences, without the packed path's
  per-step full-size gradient buffers; the input projections of all positions are one matmul.
- ``step_weights`` / ``decoder_step``: a decoder step costs one matmul per layer,
  ``[h; input] @ [W_hh W_ih]^T``, on weights cast once per sequence under autocast.
- ``tanh`` as ``2 sigmoid(2x) - 1``: torch's CPU tanh is ~6x slower than its sigmoid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.kernels.dropout import dropout


def in_autocast_dtype(x: Tensor) -> Tensor:
    """``x`` in the autocast dtype when autocast is on: a weight (or the attention memory) used at
    every time step is cast once per sequence, not once per step (autocast caches only leaf
    parameters)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


def cell_dtype(dtype: torch.dtype) -> torch.dtype:
    """The LSTM cell state's dtype: at least fp32, also under bf16/fp16 autocast."""
    return torch.promote_types(dtype, torch.float32)


class _SumBiases(torch.autograd.Function):
    """``b_ih + b_hh`` whose two gradients are separate tensors. Autograd hands an addition's one
    incoming gradient to both inputs, so the two parameters' ``.grad`` would share storage and
    every in-place gradient update (clipping, accumulation over batches) would hit it twice."""

    @staticmethod
    def forward(ctx, b_ih: Tensor, b_hh: Tensor) -> Tensor:
        return b_ih + b_hh

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, grad.clone()


def sum_biases(b_ih: Tensor, b_hh: Tensor) -> Tensor:
    return _SumBiases.apply(b_ih, b_hh)


def tanh(x: Tensor) -> Tensor:
    """``tanh x = 2 sigmoid(2x) - 1``, in at least fp32 (in bf16 the subtraction would cancel
    small values to 0)."""
    y = x.to(cell_dtype(x.dtype))
    return (torch.sigmoid(2 * y) * 2).sub_(1).to(x.dtype)


def affine(add: Tensor, x: Tensor, w: Any) -> Tensor:
    """``add + x @ w`` for x (..., in) and a (in, out) matrix ``w``, or an int8 one
    (``nmt.kernels.int8.Int8Linear`` of the transposed matrix); ``add`` is a bias, or per row
    for a 2-D ``x``."""
    if not isinstance(w, Tensor):
        return w(x).add_(add)
    return torch.addmm(add, x, w) if x.dim() == 2 else F.linear(x, w.t(), add)


def lstm_cell(gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """LSTM state update from pre-activations (..., 4H) in torch's gate order i, f, g, o. The
    cell ``c`` keeps its own (fp32) precision; ``h`` comes out in the gates' dtype, the one its
    consumers (the next step's matmuls, attention) compute in, so it is cast once, not by each.

    Without gradients (decoding) the two tanh are the sigmoid-based ``tanh``: the cell takes half
    the time at a beam search's 500 rows. Training keeps ``torch.tanh``: with the backward pass
    and the casts of bf16 gates, the extra ops measured 5-15% slower per step at 2 threads."""
    i, f, g, o = gates.chunk(4, dim=-1)
    act = torch.tanh if torch.is_grad_enabled() else tanh
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * act(g)
    return (torch.sigmoid(o) * act(c)).to(gates.dtype), c


# --- encoder -----------------------------------------------------------------------------------
def _params(rnn: nn.LSTM, name: str, layer: int) -> list[Tensor]:
    """``rnn``'s parameter ``name`` (e.g. ``weight_ih``) of the layer, per direction."""
    suffixes = ("", "_reverse")[: 2 if rnn.bidirectional else 1]
    return [getattr(rnn, f"{name}_l{layer}{s}") for s in suffixes]


def input_weights(rnn: nn.LSTM, layer: int) -> tuple[Tensor, Tensor]:
    """The layer's input weights of every direction stacked (D*4h, I) and the summed biases."""
    bias_ih, bias_hh = (torch.cat(_params(rnn, name, layer)) for name in ("bias_ih", "bias_hh"))
    return torch.cat(_params(rnn, "weight_ih", layer)), sum_biases(bias_ih, bias_hh)


def direction_masks(src_mask: Tensor, directions: int) -> Tensor:
    """(B, S) -> (S, D, B, 1): each direction's mask in its time order."""
    mask = src_mask.t().unsqueeze(-1)  # (S, B, 1)
    return torch.stack([mask, mask.flip(0)][:directions], dim=1)


def encoder_layer(rnn: nn.LSTM, x: Tensor, mask: Tensor, layer: int, int8_input: Any = None) -> tuple[Tensor, Tensor, Tensor]:
    """One layer of ``rnn``, every direction: x (B, S, I), mask (S, D, B, 1) from
    ``direction_masks`` -> outputs (B, S, D*h) (zero on padding), final h and c (B, D*h).
    ``int8_input``: the layer's input projection as an ``Int8Linear`` (inference)."""
    batch, length, dirs = x.size(0), x.size(1), 2 if rnn.bidirectional else 1
    if int8_input is not None:
        x_proj = int8_input(x.transpose(0, 1))  # (S, B, D*4h)
    else:
        x_proj = F.linear(x.transpose(0, 1), *input_weights(rnn, layer))
    x_proj = x_proj.view(length, batch, dirs, -1).transpose(1, 2)  # (S, D, B, 4h)
    if dirs == 2:  # the backward direction reads the positions last to first
        x_proj = torch.stack([x_proj[:, 0], x_proj[:, 1].flip(0)], dim=1)
    w_hh = in_autocast_dtype(torch.stack(_params(rnn, "weight_hh", layer)).transpose(1, 2))  # (D, h, 4h)
    h = x.new_zeros(dirs, batch, w_hh.size(1), dtype=w_hh.dtype)  # (D, B, h), the matmuls' dtype
    c = x.new_zeros(dirs, batch, w_hh.size(1), dtype=cell_dtype(x.dtype))
    outputs = []
    for x_t, m_t in zip(x_proj.unbind(0), mask.unbind(0)):
        h_new, c_new = lstm_cell(torch.baddbmm(x_t, h, w_hh), c)
        h, c = torch.where(m_t, h_new, h), torch.where(m_t, c_new, c)  # padding keeps the state
        outputs.append(h)
    out = torch.stack(outputs) * mask  # (S, D, B, h), zero on padding
    if dirs == 2:
        out = torch.stack([out[:, 0], out[:, 1].flip(0)], dim=1)
    out = out.permute(2, 0, 1, 3).reshape(batch, length, -1)  # (B, S, D*h)
    return out, h.transpose(0, 1).reshape(batch, -1), c.transpose(0, 1).reshape(batch, -1)


# --- decoder -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepWeights:
    """A decoder's step weights, kept in its memory; not a dict, list or tuple, so
    ``nmt.models.base.select`` leaves it alone when it reorders the batch. Each matrix is applied
    as ``x @ w`` (see ``affine``): ``emb`` (E, 4H) to the embeddings, ``bias`` the first layer's
    summed bias, and per layer the matrix applied to ``[h; input]`` with that layer's bias."""

    emb: Any
    bias: Tensor
    layers: list[tuple[Any, Tensor]]


def step_weights(rnn: nn.LSTM, emb_size: int) -> StepWeights:
    """``rnn``'s weights for stepping: the embedding columns of the first layer's input weight,
    transposed (E, 4H), its summed bias (4H,), and per layer the transposed weight applied each
    step to ``[h; input]`` (the input being the feed in the first layer; h alone without a feed),
    one matmul instead of two, with the layer's summed bias."""
    layers = []
    for layer in range(rnn.num_layers):
        w_ih, w_hh, b_ih, b_hh = (getattr(rnn, f"{name}_l{layer}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        if layer == 0:
            w_emb, w_ih = w_ih[:, :emb_size], w_ih[:, emb_size:]
        w = torch.cat([w_hh, w_ih], dim=1) if w_ih.size(1) else w_hh  # (4H, H + I)
        layers.append((in_autocast_dtype(w.t()), in_autocast_dtype(sum_biases(b_ih, b_hh))))
    return StepWeights(w_emb.t(), layers[0][1], layers)


def quantized(weights: StepWeights) -> StepWeights:
    """The same step weights as int8 matmuls (inference)."""
    from nmt.kernels.int8 import Int8Linear

    return StepWeights(Int8Linear(weights.emb.t()), weights.bias, [(Int8Linear(w.t()), b) for w, b in weights.layers])


def decoder_step(x_proj: Tensor, feed: Tensor | None, h: list[Tensor], c: list[Tensor], weights: StepWeights,
                 dropout_p: float, training: bool) -> None:
    """One step through every layer, updating the per-layer states ``h``/``c`` (lists of (B, H))
    in place. ``x_proj`` (B, 4H) is the first layer's embedding projection plus bias, for all
    steps at once ``affine(weights.bias, emb, weights.emb)``; dropout between layers as in
    ``nn.LSTM``."""
    x = feed
    for layer, (w, bias) in enumerate(weights.layers):
        if layer > 0 and dropout_p:
            x = dropout(x, dropout_p, training)
        hx = h[layer] if x is None else torch.cat([h[layer], x], dim=-1)  # (B, H + I)
        h[layer], c[layer] = lstm_cell(affine(x_proj if layer == 0 else bias, hx, w), c[layer])
        x = h[layer]

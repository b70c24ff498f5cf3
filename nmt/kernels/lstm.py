"""LSTM kernels for CPUs, on ``nn.LSTM``'s own parameters (so checkpoints are the same):

- ``encoder_layer``: one layer of a (bidirectional) encoder stepped through time, both
  directions in one batched matmul per step, a sentence's state advancing only on its own
  tokens. It computes what ``nn.LSTM`` computes on packed sequences, without the packed path's
  per-step full-size gradient buffers; the input projections of all positions are one matmul.
- ``step_weights`` / ``StepsOnWeights``: a decoder step costs one matmul per layer,
  ``[h; input] @ [W_hh W_ih]^T``, on weights cast once per sequence under autocast, and the
  embeddings of all steps are projected in one matmul.
- ``StepWeight``: in training, the gradient of a recurrent weight as one matmul over all
  steps at the end of the backward pass, not one per step;
- ``lstm_cell``: the cell as one autograd node with a hand-written backward;
- ``tanh`` as ``2 sigmoid(2x) - 1``: torch's CPU tanh is ~6x slower than its sigmoid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from nmt.kernels.dropout import dropout
from nmt.kernels.reference import cell_dtype


def in_autocast_dtype(x: Tensor) -> Tensor:
    """``x`` in the autocast dtype when autocast is on: a weight (or the attention memory) used at
    every time step is cast once per sequence, not once per step (autocast caches only leaf
    parameters)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


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


# --- the recurrent weights: one gradient matmul for all steps ------------------------------------
def _addmm(add: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    """``add + x @ weight``: (N, in) rows, or per direction (D, N, in) with (D, in, out)."""
    return (torch.addmm if x.dim() == 2 else torch.baddbmm)(add, x, weight)


class _SummedOverSteps(torch.autograd.Function):
    """The identity on a weight that every step of a sequence multiplies by; its backward, which
    runs after every step's, computes the weight's gradient from the steps' saved inputs and
    output gradients (``record``) as one matmul."""

    @staticmethod
    def forward(ctx, weight: Tensor, record: list) -> Tensor:
        ctx.record = record
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, _zero: Tensor) -> tuple[Tensor | None, None]:
        if not ctx.record:
            return None, None
        inputs, grads = zip(*ctx.record)
        ctx.record.clear()
        dim = inputs[0].dim() - 2  # the rows: (N, in) or (D, N, in)
        return torch.cat(inputs, dim).transpose(-2, -1) @ torch.cat(grads, dim), None


class _StepProduct(torch.autograd.Function):
    """``add + x @ weight`` (or per direction, ``baddbmm``) in the weight's dtype; its backward
    gives ``add`` and ``x`` their gradients and leaves the weight's to ``_SummedOverSteps``."""

    @staticmethod
    def forward(ctx, add: Tensor, x: Tensor, weight: Tensor, record: list) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x_in = x.to(weight.dtype)
            out = _addmm(add.to(weight.dtype), x_in, weight)
        ctx.save_for_backward(x_in, weight)
        ctx.record, ctx.add_shape, ctx.dtypes = record, add.shape, (add.dtype, x.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        ctx.record.append((x, grad))
        grad_add = grad if grad.shape == ctx.add_shape else grad.sum_to_size(ctx.add_shape)
        return grad_add.to(ctx.dtypes[0]), (grad @ weight.transpose(-2, -1)).to(ctx.dtypes[1]), None, None


class StepWeight:
    """A recurrent weight (in, out), or one per direction (D, in, out), that every time step
    multiplies by: ``product(add, x) = add + x @ weight``. Autograd would compute its gradient
    as one small matmul per step (over the batch's rows) summed in the weight's dtype; here the
    steps save their inputs and output gradients and the gradient is one matmul over steps x rows
    at the end of the backward pass, accumulated in fp32 inside it."""

    def __init__(self, weight: Tensor) -> None:
        self.record: list[tuple[Tensor, Tensor]] = []
        self.tracked = torch.is_grad_enabled() and weight.requires_grad
        self.weight = _SummedOverSteps.apply(weight, self.record) if self.tracked else weight

    def product(self, add: Tensor, x: Tensor) -> Tensor:
        if self.tracked:
            return _StepProduct.apply(add, x, self.weight, self.record)
        return _addmm(add, x, self.weight)


def affine(add: Tensor, x: Tensor, w: Any) -> Tensor:
    """``add + x @ w`` for x (..., in) and a (in, out) matrix ``w``, a ``StepWeight``, or an int8
    one (``nmt.kernels.int8.Int8Linear`` of the transposed matrix); ``add`` is a bias, or per row
    for a 2-D ``x``."""
    if isinstance(w, StepWeight):
        return w.product(add, x)
    if not isinstance(w, Tensor):
        return w(x).add_(add)
    return torch.addmm(add, x, w) if x.dim() == 2 else F.linear(x, w.t(), add)


class _Cell(torch.autograd.Function):
    """The LSTM cell as one autograd node, in at least fp32 whatever the gates' dtype:

    - forward: one sigmoid over all four gates, the cell input's tanh from it
      (``tanh x = 2 sigmoid(2x) - 1``: its columns are doubled first), then
      ``c' = f c + i g`` and ``h = o tanh c'``;
    - backward by hand from the saved activations, ``d sigmoid = s (1 - s)`` over all four gates
      at once (``1 - g^2`` for the cell input): about half the small ops autograd's graph of the
      same formula runs per time step, which is what a stepped LSTM spends its non-matmul time on.
    """

    @staticmethod
    def forward(ctx, gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        size = c.size(-1)
        s = gates.to(cell_dtype(gates.dtype), copy=True)
        s[..., 2 * size : 3 * size].mul_(2)
        s.sigmoid_()
        i, f, g, o = s.split(size, dim=-1)
        g.mul_(2).sub_(1)  # tanh of the cell input, in place
        c_new = (f * c).addcmul_(i, g)
        tanh_c = tanh(c_new)
        ctx.save_for_backward(s, c, tanh_c)
        ctx.dtypes = (gates.dtype, c.dtype)
        return (o * tanh_c).to(gates.dtype), c_new

    @staticmethod
    def backward(ctx, grad_h: Tensor, grad_c: Tensor) -> tuple[Tensor, Tensor]:
        # an unused output's gradient arrives as zeros (autograd materialises it)
        s, c, tanh_c = ctx.saved_tensors
        size = c.size(-1)
        i, f, g, o = s.split(size, dim=-1)
        grad_h = grad_h.to(tanh_c.dtype)
        # dL/dc' = dL/dh o (1 - tanh^2 c') + dL/dc'
        dc = (1 - tanh_c * tanh_c).mul_(o).mul_(grad_h).add_(grad_c)
        grad = s * (1 - s)  # d sigmoid of each gate ...
        grad_g = grad[..., 2 * size : 3 * size]
        torch.addcmul(torch.ones_like(g), g, g, value=-1, out=grad_g)  # ... and d tanh of the cell input
        gi, gf, gg, go = grad.split(size, dim=-1)
        gi.mul_(dc).mul_(g)
        gf.mul_(dc).mul_(c)
        gg.mul_(dc).mul_(i)
        go.mul_(grad_h).mul_(tanh_c)
        return grad.to(ctx.dtypes[0]), (dc * f).to(ctx.dtypes[1])


def lstm_cell(gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """LSTM state update from pre-activations (..., 4H) in torch's gate order i, f, g, o. The
    cell ``c`` keeps its own (fp32) precision; ``h`` comes out in the gates' dtype, the one its
    consumers (the next step's matmuls, attention) compute in, so it is cast once, not by each.

    Both tanh are the sigmoid-based ``tanh``. In training the cell is one autograd node
    (``_Cell``); without gradients (decoding) the same ops run unrecorded."""
    if torch.is_grad_enabled() and (gates.requires_grad or c.requires_grad):
        return _Cell.apply(gates, c)
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * tanh(g)
    return (torch.sigmoid(o) * tanh(c)).to(gates.dtype), c


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
    w_hh = StepWeight(in_autocast_dtype(torch.stack(_params(rnn, "weight_hh", layer)).transpose(1, 2)))  # (D, h, 4h)
    size, dtype = w_hh.weight.size(1), w_hh.weight.dtype
    h = x.new_zeros(dirs, batch, size, dtype=dtype)  # (D, B, h), the matmuls' dtype
    c = x.new_zeros(dirs, batch, size, dtype=cell_dtype(x.dtype))
    outputs = []
    full = mask.flatten(1).all(1).tolist()  # steps where no sentence of either direction is padding
    for x_t, m_t, no_padding in zip(x_proj.unbind(0), mask.unbind(0), full):
        h_new, c_new = lstm_cell(w_hh.product(x_t, h), c)
        if no_padding:
            h, c = h_new, c_new
        else:  # padding keeps the state
            h, c = torch.where(m_t, h_new, h), torch.where(m_t, c_new, c)
        outputs.append(h)
    out = torch.stack(outputs) * mask  # (S, D, B, h), zero on padding
    if dirs == 2:
        out = torch.stack([out[:, 0], out[:, 1].flip(0)], dim=1)
    out = out.permute(2, 0, 1, 3).reshape(batch, length, -1)  # (B, S, D*h)
    return out, h.transpose(0, 1).reshape(batch, -1), c.transpose(0, 1).reshape(batch, -1)


def encoder(rnn: nn.LSTM, x: Tensor, src_mask: Tensor, checkpointing: bool, int8_inputs: list[Any] | None = None
            ) -> tuple[Tensor, Tensor, Tensor]:
    """What ``nn.LSTM`` computes on packed sequences, layer by layer with ``encoder_layer``:
    x (B, S, I) -> outputs (B, S, D*h), final h and c (B, L, D*h). ``checkpointing``: keep only
    each layer's input; ``int8_inputs``: every layer's input projection as an ``Int8Linear``."""
    mask = direction_masks(src_mask, 2 if rnn.bidirectional else 1)  # (S, D, B, 1)
    final_h, final_c = [], []
    for layer in range(rnn.num_layers):
        if layer > 0:  # between layers, as nn.LSTM
            x = dropout(x, rnn.dropout, rnn.training)
        int8 = int8_inputs[layer] if int8_inputs is not None else None
        if checkpointing:
            x, h, c = checkpoint(encoder_layer, rnn, x, mask, layer, int8, use_reentrant=False)
        else:
            x, h, c = encoder_layer(rnn, x, mask, layer, int8)
        final_h.append(h)
        final_c.append(c)
    return x, torch.stack(final_h, 1), torch.stack(final_c, 1)


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
        layers.append((StepWeight(in_autocast_dtype(w.t())), in_autocast_dtype(sum_biases(b_ih, b_hh))))
    return StepWeights(w_emb.t(), layers[0][1], layers)


def quantized(weights: StepWeights) -> StepWeights:
    """The same step weights as int8 matmuls (inference)."""
    from nmt.kernels.int8 import Int8Linear

    return StepWeights(Int8Linear(weights.emb.t()), weights.bias, [(Int8Linear(w.weight.t()), b) for w, b in weights.layers])


class StepsOnWeights:
    """``nmt.kernels.reference.LSTMSteps`` on ``StepWeights``: the step inputs are the
    embeddings' projections for all steps in one matmul, a layer's step one matmul on
    ``[h; input]``."""

    def __init__(self, rnn: nn.LSTM, weights: StepWeights) -> None:
        self.rnn, self.weights = rnn, weights

    def inputs(self, emb: Tensor) -> tuple[Tensor, ...]:
        """emb (B, T, E) -> the first layer's embedding projection plus bias (B, 4H) per step."""
        return affine(self.weights.bias, emb.transpose(0, 1), self.weights.emb).unbind(0)  # from (T, B, 4H)

    def step(self, x: Tensor, feed: Tensor | None, h: list[Tensor], c: list[Tensor]) -> None:
        """One step through every layer, updating the per-layer states ``h``/``c`` (lists of
        (B, H)) in place; dropout between layers as in ``nn.LSTM``."""
        dropout_p, training = self.rnn.dropout, self.rnn.training
        x_proj, x = x, feed
        for layer, (w, bias) in enumerate(self.weights.layers):
            if layer > 0 and dropout_p:
                x = dropout(x, dropout_p, training)
            hx = h[layer] if x is None else torch.cat([h[layer], x], dim=-1)  # (B, H + I)
            h[layer], c[layer] = lstm_cell(affine(x_proj if layer == 0 else bias, hx, w), c[layer])
            x = h[layer]

"""Bahdanau's additive score ``v^T tanh(q + k)`` as one autograd node (a CPU kernel; the
reference is those three ops in ``nmt.models.attention``)."""

from __future__ import annotations

import torch
from torch import Tensor


class _AdditiveScore(torch.autograd.Function):
    """``v^T tanh(q + k)`` for every (query, key) pair: (B, T, S, A) work, the largest elementwise
    op of an RNN decoder step, written out by hand:

    - ``tanh x = 2 sigmoid(2x) - 1`` (equal to rounding; torch's CPU tanh is ~6x slower than its
      sigmoid): scores ``v^T (2 s - 1)`` with ``s = sigmoid(2 (q + k))``;
    - ``s`` is recomputed in backward rather than saved: a step-by-step decoder would otherwise
      keep a fresh (B, S, A) buffer per target step, hundreds of MB per batch, where recomputing
      reuses one cache-resident buffer;
    - each pass uses one (B, T, S, A) buffer in place where autograd would allocate four.
    """

    @staticmethod
    def _sigmoid(query: Tensor, keys: Tensor) -> Tensor:
        return (keys.unsqueeze(1) + query.unsqueeze(2)).mul_(2).sigmoid_()  # (B, T, S, A)

    @staticmethod
    def forward(ctx, query: Tensor, keys: Tensor, v: Tensor) -> Tensor:
        s = _AdditiveScore._sigmoid(query, keys)
        v = v.to(s.dtype)
        ctx.save_for_backward(query, keys, v)
        return torch.matmul(s, 2 * v) - v.sum()  # (B, T, S)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        query, keys, v = ctx.saved_tensors
        s = _AdditiveScore._sigmoid(query, keys)
        grad = grad.to(s.dtype)
        grad_v = 2 * torch.matmul(grad.reshape(1, -1), s.reshape(-1, s.size(-1))).view(-1) - grad.sum()
        # d score / d (q + k) = 4 v s (1 - s)
        d = grad.unsqueeze(-1) * (4 * v)  # (B, T, S, A)
        d.mul_(s).addcmul_(d, s, value=-1)
        grad_keys = d.squeeze(1) if d.size(1) == 1 else d.sum(1)
        return d.sum(2), grad_keys, grad_v


def additive_score(v: Tensor, query: Tensor, keys: Tensor) -> Tensor:
    """``v^T tanh(query + key)`` for every (step, source) pair: v (A,), query (B, T, A), keys
    (B, S, A) -> (B, T, S)."""
    return _AdditiveScore.apply(query, keys, v)

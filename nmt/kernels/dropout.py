"""Dropout with a cheaper random mask (a CPU kernel; ``F.dropout`` is the reference, and
``nmt.models.dropout.Dropout`` the module that chooses through the model's kernels).

torch's CPU dropout draws one random number per element (``bernoulli_``), ~10 ns each: 4-6% of
an LSTM training step. Here one 64-bit draw gives four 16-bit uniforms, so a mask costs a
quarter of the draws; an element is kept when its uniform is at or above ``round(p 2^16)``,
so the drop probability is ``p`` rounded to a multiple of 2^-16 (exact for 0.1, 0.2, 0.25, ...
within 1e-5) and the kept elements are scaled by ``1 / (1 - p)`` for that rounded ``p``.
Other devices use ``F.dropout``, whose kernels draw their randomness in bulk already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_LEVELS = 1 << 16


def _keep_mask(shape: torch.Size, p: float, device: torch.device) -> tuple[Tensor, float]:
    """A bool mask of ``shape``, True with probability ``1 - p`` (``p`` rounded to 2^-16), and
    the scale ``1 / (1 - p)`` for the kept elements."""
    dropped = round(p * _LEVELS)
    n = shape.numel()
    bits = torch.randint(-(1 << 63), (1 << 63) - 1, ((n + 3) // 4,), dtype=torch.int64, device=device)
    uniform = bits.view(torch.int16)[:n].view(shape)  # 16-bit uniforms in [-2^15, 2^15)
    return uniform >= dropped - _LEVELS // 2, _LEVELS / (_LEVELS - dropped)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        keep, scale = _keep_mask(x.shape, p, x.device)
        mask = keep.to(x.dtype).mul_(scale)  # 0 or 1 / (1 - p)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (mask,) = ctx.saved_tensors
        return grad * mask, None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)``, with the cheaper mask on CPU."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, got {p}")
    if not training or p == 0.0 or x.numel() == 0:
        return x
    if x.device.type != "cpu" or round(p * _LEVELS) == _LEVELS or torch.compiler.is_compiling():
        return F.dropout(x, p, training)  # (compiled graphs draw their own randomness in bulk)
    return _Dropout.apply(x, p)


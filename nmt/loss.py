"""Label-smoothed cross-entropy (Szegedy et al. 2016) as one autograd node.

For logits ``z`` (N, V), targets ``y`` and ``log p = log_softmax(z)``:

    nll_i    = -log p_{i, y_i}
    smooth_i = -mean_v log p_{i, v}             (cross-entropy against the uniform distribution)
    loss     = mean_i [(1 - eps) nll_i + eps smooth_i]

which is ``F.cross_entropy(z, y, label_smoothing=eps)``. Its gradient is
``(softmax(z) - (1 - eps) onehot(y) - eps / V) / N``, written in place over the saved log
probabilities (fp32 also for bf16 logits, which are read once and never copied to fp32);
autograd's path through ``log_softmax``, ``gather`` and ``mean`` materialises four (N, V)
tensors, and the vocabulary projection's outputs are the largest tensors of a training step.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _SmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 for bf16/fp16 logits
        log_probs = torch.log_softmax(logits, dim=-1, dtype=dtype)  # (N, V), one pass
        nll = -log_probs.gather(1, target.unsqueeze(1)).squeeze(1)
        loss = nll.mean() if not eps else ((1 - eps) * nll - eps * log_probs.mean(dim=-1)).mean()
        ctx.save_for_backward(log_probs, target)
        ctx.eps, ctx.dtype = eps, logits.dtype
        nll = nll.mean()
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor, None, None]:
        log_probs, target = ctx.saved_tensors
        n, v = log_probs.shape
        eps = ctx.eps
        grad = log_probs.exp_()  # softmax, in the saved buffer: backward runs once
        if eps:
            grad.sub_(eps / v)
        grad.scatter_add_(1, target.unsqueeze(1), grad.new_full((n, 1), eps - 1))
        out = torch.empty_like(grad, dtype=ctx.dtype)
        return torch.mul(grad, grad_loss / n, out=out), None, None  # scaled and cast in one pass


def label_smoothed_cross_entropy(logits: Tensor, target: Tensor, eps: float = 0.0) -> tuple[Tensor, Tensor]:
    """Mean label-smoothed loss over the rows of ``logits`` (N, V) with targets (N,), and the
    mean plain NLL (no gradient, for perplexity)."""
    if logits.size(0) == 0:
        raise ValueError("label_smoothed_cross_entropy: no target tokens in the batch")
    return _SmoothedCrossEntropy.apply(logits, target, float(eps))

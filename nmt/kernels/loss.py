"""The output layer and label-smoothed cross-entropy (Szegedy et al. 2016) as one autograd node.

For decoder states ``h`` (N, H), the output weight ``W`` (V, H) and bias ``b`` (V,; none: 0),
logits ``z = h W^T + b``, targets ``y`` and ``log p = log_softmax(z)``:

    nll_i    = -log p_{i, y_i}
    smooth_i = -mean_{v in K} log p_{i, v}      (cross-entropy against the uniform distribution on K)
    loss     = mean_i [(1 - eps) nll_i + eps smooth_i]

where K is the vocabulary less the entries no target can be (``not_targets``: padding and BOS,
which no target and no search ever uses, as OpenNMT-py leaves padding out); with none left out
it is ``F.cross_entropy(F.linear(h, W), y, label_smoothing=eps)``. The gradient with respect to
the logits is ``G = (softmax(z) - (1 - eps) onehot(y) - eps / |K| [v in K]) / N``, so the forward pass
computes it too (unless no gradient is needed, as in validation), a block of rows at a time: the
block's logits and their softmax (fp32, in place, with ``log sum exp z`` for the loss) stay in
the CPU cache, and only ``G`` is written, in the matmul dtype (bf16 under autocast). The
backward pass is then two matmuls, ``G W`` and ``G^T h``, and the bias's column sums of ``G``.
The bias is added by each block's matmul (``addmm``), never joined to ``W``: a copy of the
output layer per step would cost a model of NLLB-200's 256k pieces a GiB. Autograd's path (logits, an fp32 copy,
log-softmax, its gradient, each (N, V), the largest tensors of a training step) moves several
times the memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Logits per block in the forward pass: ~4 MB of fp32 on a CPU (cache-sized), more on a GPU.
_BLOCK_ELEMENTS = {"cpu": 1 << 20}
_DEFAULT_BLOCK_ELEMENTS = 1 << 24
_LOG2E = 1.4426950408889634


def _matmul_dtype(x: Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class _OutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, eps: float,
                block_rows: int, not_targets: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        dtype = _matmul_dtype(hidden)
        h, w = hidden.to(dtype), weight.to(dtype)
        bias_m = None if bias is None else bias.to(dtype)
        n, v = h.size(0), w.size(0)
        fp = torch.promote_types(dtype, torch.float32)  # the softmax's dtype
        need_grad = any(ctx.needs_input_grad[:3])  # not in validation
        grad_logits = h.new_empty(n, v) if need_grad else None
        # one logits buffer for every block (and an fp32 one under autocast): fresh multi-MB
        # tensors per block would each cost page faults
        logits = h.new_empty(min(block_rows, n), v)
        logits_fp = logits if fp == dtype else logits.new_empty(logits.shape, dtype=fp)
        left_out = list(not_targets)
        smoothed = v - len(left_out)  # |K|: the entries the smoothed mass is spread over
        with torch.autocast(h.device.type, enabled=False):  # fp32 also under autocast
            w_mean = (w.sum(0, dtype=fp) - w[left_out].sum(0, dtype=fp)) / smoothed
            mean_logit = h.to(fp) @ w_mean  # (N,): mean_{v in K} z_v, for the smoothing term
            if bias_m is not None:
                mean_logit += (bias_m.sum(dtype=fp) - bias_m[left_out].sum(dtype=fp)) / smoothed
        loss_sum = nll_sum = h.new_zeros((), dtype=fp)
        for start in range(0, n, block_rows):
            rows = slice(start, start + block_rows)
            b = min(block_rows, n - start)
            if bias_m is None:
                z = torch.mm(h[rows], w.t(), out=logits[:b])
            else:
                z = torch.addmm(bias_m, h[rows], w.t(), out=logits[:b])
            if z.dtype != fp:
                z = logits_fp[:b].copy_(z)
            y = target[rows].unsqueeze(1)
            z_max = z.amax(dim=-1, keepdim=True)
            z_y = z.gather(1, y).squeeze(1)
            # exp(z - max) as exp2((z - max) log2 e): torch's CPU exp2 is ~3x faster than its exp
            exp = z.sub_(z_max).mul_(_LOG2E).exp2_()
            total = exp.sum(dim=-1, keepdim=True)
            log_total = (total.log() + z_max).squeeze(1)  # log sum_v exp z_v
            nll = (log_total - z_y).sum()
            nll_sum = nll_sum + nll
            loss_sum = loss_sum + ((1 - eps) * nll + eps * (log_total - mean_logit[rows]).sum() if eps else nll)
            if need_grad:
                probs = exp.mul_(total.reciprocal_())
                probs.sub_(eps / smoothed).scatter_add_(1, y, probs.new_full(y.shape, eps - 1))
                if left_out and eps:
                    probs[:, left_out] += eps / smoothed  # no smoothed mass there
                grad_logits[rows] = probs  # unscaled by 1/N, cast to the matmul dtype
        ctx.save_for_backward(h, w, grad_logits)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        nll = nll_sum / n
        ctx.mark_non_differentiable(nll)
        return loss_sum / n, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        h, w, grad_logits = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]  # a frozen output layer (fine-tuning) needs none
        scale = grad_loss / h.size(0)
        if grad_logits.dtype == torch.float16:  # scaled first, so fp16 loss scaling governs the range
            grad_logits = grad_logits * scale.to(grad_logits.dtype)
            return ((grad_logits @ w).to(ctx.dtypes[0]) if need_hidden else None,
                    (grad_logits.t() @ h).to(ctx.dtypes[1]) if need_weight else None,
                    grad_logits.sum(0, dtype=torch.float32).to(ctx.dtypes[2]) if need_bias else None, None, None, None, None)
        grad_hidden = (grad_logits @ w).to(ctx.dtypes[0]).mul_(scale) if need_hidden else None
        grad_weight = (grad_logits.t() @ h).to(ctx.dtypes[1]).mul_(scale) if need_weight else None
        grad_bias = grad_logits.sum(0, dtype=torch.float32).mul_(scale).to(ctx.dtypes[2]) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def output_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, eps: float = 0.0,
                         block_rows: int | None = None, not_targets: tuple[int, ...] = (),
                         bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Mean label-smoothed loss of the logits ``hidden @ weight.T + bias`` (hidden (N, H), weight
    (V, H), bias (V,) or None) against targets (N,), the smoothed mass spread over the entries other than
    ``not_targets``, and the mean plain NLL (no gradient, for perplexity). Matmuls run in the
    autocast dtype when autocast is on; the softmax and the loss in fp32 at least."""
    if hidden.size(0) == 0:
        raise ValueError("output_cross_entropy: no target tokens in the batch")
    if block_rows is None:
        block_rows = max(1, _BLOCK_ELEMENTS.get(hidden.device.type, _DEFAULT_BLOCK_ELEMENTS) // weight.size(0))
    if bias is not None and bias.shape != (weight.size(0),):
        raise ValueError(f"output_cross_entropy: a bias of shape {tuple(bias.shape)} for {weight.size(0)} output rows")
    return _OutputCrossEntropy.apply(hidden, weight, bias, target, float(eps), block_rows,
                                     smoothed_out(not_targets, weight.size(0)))


def smoothed_out(not_targets: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    """The distinct entries label smoothing leaves out, checked against the vocabulary."""
    left_out = tuple(sorted({int(i) for i in not_targets}))
    if any(i < 0 or i >= vocab_size for i in left_out) or len(left_out) >= vocab_size:
        raise ValueError(f"label smoothing: not_targets {list(left_out)} must be entries of a vocabulary of "
                         f"{vocab_size}, and leave some out of them")
    return left_out

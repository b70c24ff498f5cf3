"""Attention on CPUs: which of torch's attention kernels win there.

- Decoding steps: for one query per sentence (or a sentence's beams over its shared keys),
  torch's fused CPU kernel is 3-5x slower than two matmuls and a softmax (``eager_for``).
- Training under bf16 autocast: torch's bf16 flash-attention backward on CPU is ~4x slower than
  its fp32 one, so attention runs in fp32 while the projections stay bf16 (``sdpa``).

And one choice on GPUs (``shape_free``): cuDNN's attention builds an execution plan for every new
shape, about 8 ms of host time per call on an H200 (docs/results/gpu/), and length-bucketed batches
and decoding steps bring a new shape almost every call, so the Transformer preset trained at 7k
target tokens/s there. Torch's flash and memory-efficient kernels need no plan; SDPA is asked to
choose among them (and the math fallback) only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPE_FREE = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
              SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
              SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled}


def shape_free_backends() -> list[SDPBackend] | None:
    """The backends ``shape_free`` narrows SDPA to: the enabled ones but cuDNN; None (no narrowing)
    where cuDNN is not enabled, or where a caller's ``sdpa_kernel`` left it and no kernel that
    serves every input (memory-efficient or math: flash takes no mask)."""
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return None
    allowed = [backend for backend, enabled in SHAPE_FREE.items() if enabled()]
    return allowed if SDPBackend.EFFICIENT_ATTENTION in allowed or SDPBackend.MATH in allowed else None


def shape_free(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, is_causal: bool) -> Tensor:
    """``scaled_dot_product_attention`` without cuDNN's kernel on CUDA (see above, and
    ``shape_free_backends``); elsewhere as is."""
    allowed = shape_free_backends() if q.is_cuda else None
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)
    with sdpa_kernel(allowed):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)


def eager_for(q: Tensor, grouped: bool) -> bool:
    """Whether plain matmuls beat SDPA for these CPU queries: a decoding step's one query, or
    grouped ones (beams sharing their sentence's keys)."""
    return q.device.type == "cpu" and (q.size(-2) == 1 or grouped)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, is_causal: bool) -> Tensor:
    """``scaled_dot_product_attention``, in fp32 under CPU autocast (the output in q's dtype)."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                 dropout_p=dropout, is_causal=is_causal)
        return out.to(q.dtype)
    return shape_free(q, k, v, mask, dropout, is_causal)

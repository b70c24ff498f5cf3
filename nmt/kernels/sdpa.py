"""Attention on CPUs: which of torch's attention kernels win there.

- Decoding steps: for one query per sentence (or a sentence's beams over its shared keys),
  torch's fused CPU kernel is 3-5x slower than two matmuls and a softmax (``eager_for``).
- Training under bf16 autocast: torch's bf16 flash-attention backward on CPU is ~4x slower than
  its fp32 one, so attention runs in fp32 while the projections stay bf16 (``sdpa``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)

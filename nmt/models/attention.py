"""Attention for the RNN decoder: score a query against source states and mix them; and
``grouped``, how every attention (these and the Transformer's cross-attention) lets a sentence's
beams read one copy of its memory.

Every variant has the same two calls:

- ``project_keys(values (B, S, Hk)) -> keys (B, S, K)``: the query-independent part of the
  score, computed once per sentence by ``RNNDecoder.prepare_memory`` and kept in ``memory``.
- ``forward(query (B, Hq), keys (B, S, K), values (B, S, Hk), mask (B, S))
  -> (context (B, Hk), weights (B, S))``; ``mask`` is True on real tokens. A query of shape
  (B, T, Hq) scores T decoder steps at once, giving (B, T, Hk) and (B, T, S). The query may
  have g times the memory's rows (``grouped``).

Attention only scores and mixes; the decoder owns the wiring (input feeding, the attentional
layer ``tanh(W_c [c; h])``). The additive score goes through the model's kernels
(``nmt.kernels``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from nmt.kernels import UsesKernels

Outputs = tuple[Tensor, Tensor | None]


def grouped(attend: Callable[[Tensor], Outputs], query: Tensor, memory_rows: int) -> Outputs:
    """Attention of queries with g times the memory's rows, rows i*g .. i*g + g - 1 reading
    memory row i (beam search keeps one copy of a sentence's memory for its g beams): each
    sentence's g*T queries are scored together, in one call ``attend(queries (B, ..., g*T, D))
    -> outputs (B, ..., g*T, .)`` (or None). ``query`` is (B*g, ..., T, D), or (B*g, D) for one
    step; the outputs come back in its layout, (B*g, ..., T, .)."""
    if query.dim() == 2:
        return tuple(None if y is None else y.squeeze(-2) for y in grouped(attend, query.unsqueeze(-2), memory_rows))
    if query.size(0) % memory_rows:
        raise ValueError(f"{query.size(0)} query rows for {memory_rows} memory rows: not a multiple")
    g = query.size(0) // memory_rows
    if g == 1:
        return attend(query)
    x = query.view(memory_rows, g, *query.shape[1:]).movedim(1, -3)  # (B, ..., g, T, D)
    outputs = attend(x.reshape(*x.shape[:-3], -1, x.size(-1)))  # (B, ..., g*T, .)
    return tuple(None if y is None else y.unflatten(-2, (g, -1)).movedim(-3, 1).flatten(0, 1) for y in outputs)


def _mix(scores: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Masked softmax over source positions, then the weighted sum of ``values``: scores
    (B, T, S) -> context (B, T, Hk), weights (B, T, S)."""
    weights = torch.softmax(scores.masked_fill(~mask.unsqueeze(1), float("-inf")), dim=-1)
    return torch.bmm(weights, values), weights


class _Attention(UsesKernels, nn.Module):
    """``forward`` for every variant: softmax and mix of the variant's ``scores`` of queries
    (B, T, Hq) against keys (B, S, K) -> (B, T, S)."""

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return grouped(lambda q: _mix(self.scores(q, keys), values, mask), query, keys.size(0))

    def _additive(self, query: Tensor, keys: Tensor) -> Tensor:
        """``v^T tanh(W q + k)``, the key side projected already (``project_keys``)."""
        q = self.query_proj(query)  # (B, T, A)
        return self.kernels.ops(q).additive_score(self.v.weight.view(-1), q, keys)


class BahdanauAttention(_Attention):
    """Additive attention, Bahdanau et al. 2015 (eq. 6, appendix A.1.2):
    ``e_ij = v^T tanh(W s_{i-1} + U h_j)``."""

    def __init__(self, query_size: int, key_size: int, attn_size: int | None = None) -> None:
        super().__init__()
        attn_size = attn_size or query_size
        self.query_proj = nn.Linear(query_size, attn_size, bias=False)  # W
        self.key_proj = nn.Linear(key_size, attn_size, bias=True)  # U (+ bias)
        self.v = nn.Linear(attn_size, 1, bias=False)

    def project_keys(self, values: Tensor) -> Tensor:
        return self.key_proj(values)  # (B, S, A)

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        return self._additive(query, keys)


class LuongAttention(_Attention):
    """Global attention, Luong et al. 2015 (eq. 8): ``score(h_t, h_s)`` is
    ``dot``: h_t^T h_s; ``general``: h_t^T W_a h_s; ``concat``: v_a^T tanh(W_a [h_t; h_s])."""

    def __init__(self, query_size: int, key_size: int, score: str = "general") -> None:
        super().__init__()
        if score not in ("dot", "general", "concat"):
            raise ValueError(f"LuongAttention score must be 'dot', 'general' or 'concat', got {score!r}")
        if score == "dot" and query_size != key_size:
            raise ValueError(
                f"LuongAttention score='dot' needs query_size == key_size, got {query_size} and "
                f"{key_size}; use score='general'"
            )
        self.score = score
        if score == "general":
            self.key_proj = nn.Linear(key_size, query_size, bias=False)  # W_a h_s
        elif score == "concat":
            # W_a [h_t; h_s] = W_q h_t + W_k h_s: the key half is computed once per sentence.
            self.key_proj = nn.Linear(key_size, query_size, bias=True)
            self.query_proj = nn.Linear(query_size, query_size, bias=False)
            self.v = nn.Linear(query_size, 1, bias=False)

    def project_keys(self, values: Tensor) -> Tensor:
        return values if self.score == "dot" else self.key_proj(values)

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        if self.score == "concat":
            return self._additive(query, keys)
        return torch.bmm(query, keys.transpose(1, 2))  # (B, T, S)

"""Attention for the RNN decoder: score a query against source states and mix them.

Every variant has the same two calls:

- ``project_keys(values (B, S, Hk)) -> keys (B, S, K)``: the query-independent part of the
  score, computed once per sentence by ``RNNDecoder.prepare_memory`` and kept in ``memory``.
- ``forward(query (B, Hq), keys (B, S, K), values (B, S, Hk), mask (B, S))
  -> (context (B, Hk), weights (B, S))``; ``mask`` is True on real tokens. A query of shape
  (B, T, Hq) scores T decoder steps at once, giving (B, T, Hk) and (B, T, S). The query may
  have g times the memory's rows, rows i*g .. i*g + g - 1 reading memory row i (beam search
  keeps one copy of a sentence's memory for its g beams); their queries are scored together.

Attention only scores and mixes; the decoder owns the wiring (input feeding, the attentional
layer ``tanh(W_c [c; h])``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nmt.kernels import Switchable
from nmt.kernels.attention import additive_score


def _grouped(query: Tensor, memory_rows: int) -> Tensor:
    """Queries (B*g, Hq) or (B*g, T, Hq) -> (B, g*T, Hq): the queries of each memory row."""
    if query.size(0) % memory_rows:
        raise ValueError(f"{query.size(0)} query rows for {memory_rows} memory rows: not a multiple")
    return query.reshape(memory_rows, -1, query.size(-1))


def _mix(scores: Tensor, values: Tensor, mask: Tensor, query_shape: torch.Size) -> tuple[Tensor, Tensor]:
    """Masked softmax over source positions, then the weighted sum of ``values``; scores
    (B, g*T, S) -> context and weights in the query's shape (``query_shape[:-1]``)."""
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))  # (B, g*T, S)
    weights = torch.softmax(scores, dim=-1)
    context = torch.bmm(weights, values)  # (B, g*T, Hk)
    rows = query_shape[:-1]
    return context.reshape(*rows, -1), weights.reshape(*rows, -1)


def _additive(module: Switchable, v: nn.Linear, query: Tensor, keys: Tensor) -> Tensor:
    """``v^T tanh(query + key)`` for every (step, source) pair: (B, T, A), (B, S, A) -> (B, T, S)."""
    if module.fast(query):
        return additive_score(v.weight.view(-1), query, keys)
    return v(torch.tanh(query.unsqueeze(2) + keys.unsqueeze(1))).squeeze(-1)


class BahdanauAttention(Switchable, nn.Module):
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

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        grouped = _grouped(self.query_proj(query), keys.size(0))  # (B, g*T, A)
        return _mix(_additive(self, self.v, grouped, keys), values, mask, query.shape)


class LuongAttention(Switchable, nn.Module):
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

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        if self.score == "concat":
            scores = _additive(self, self.v, _grouped(self.query_proj(query), keys.size(0)), keys)
        else:
            scores = torch.bmm(_grouped(query, keys.size(0)), keys.transpose(1, 2))  # (B, g*T, S)
        return _mix(scores, values, mask, query.shape)

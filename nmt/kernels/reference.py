"""The operations every kernel replaces, in plain PyTorch: what the models compute on a GPU
(cuDNN's LSTM, SDPA's fused attention) and, with ``kernels=reference``, everywhere.

``ReferenceOps`` is one method per operation a model leaves to its ``Kernels``; ``CPUOps``
(``nmt.kernels.cpu``) overrides them with the CPU kernels, same signatures, and the tests run
both.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils.checkpoint import checkpoint

from nmt.kernels.loss import smoothed_out
from nmt.kernels.sdpa import shape_free


def cell_dtype(dtype: torch.dtype) -> torch.dtype:
    """The LSTM cell state's dtype: at least fp32, also under bf16/fp16 autocast."""
    return torch.promote_types(dtype, torch.float32)


def lstm_step(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor) -> tuple[Tensor, Tensor]:
    """One LSTM step (torch's gate order i, f, g, o): ``x`` (B, I), h/c (B, H). Under bf16/fp16
    autocast the gates' matmuls run in the low precision, but the cell, which sums every step's
    update, is computed and returned in at least fp32 (``cell_dtype``); ``h`` comes out in the
    gates' dtype, the one the matmuls that read it compute in. In fp32 nothing is cast."""
    gates = F.linear(x, w_ih, b_ih) + F.linear(h, w_hh, b_hh)
    i, f, g, o = gates.to(cell_dtype(gates.dtype)).chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return (torch.sigmoid(o) * torch.tanh(c)).to(gates.dtype), c


class LSTMSteps:
    """An ``nn.LSTM`` stepped one position at a time on its own weights, as the equations read
    (a decoder with a feed, and decoding). ``inputs`` turns the embeddings (B, T, E) into each
    step's input, ``step`` advances every layer's state by one position. ``of_weights`` builds
    one from the weights alone (what a compiled step receives: ``torch.compile`` does not trace
    ``nn.LSTM`` modules)."""

    def __init__(self, rnn: nn.LSTM) -> None:
        self.layers = lstm_weights(rnn)
        self.dropout, self.training = rnn.dropout, rnn.training

    @classmethod
    def of_weights(cls, layers: tuple[tuple[Tensor, ...], ...], dropout: float, training: bool) -> "LSTMSteps":
        steps = cls.__new__(cls)
        steps.layers, steps.dropout, steps.training = layers, dropout, training
        return steps

    def inputs(self, emb: Tensor) -> tuple[Any, ...]:
        """The embeddings (B, T, E) as T step inputs (unbind: one backward node, no per-step zeros)."""
        return emb.unbind(1)

    def step(self, x: Any, feed: Tensor | None, h: list[Tensor], c: list[Tensor]) -> None:
        """One step through every layer, updating the per-layer states ``h``/``c`` (lists of
        (B, H)) in place; the first layer reads ``[x; feed]``. Dropout between layers as in
        ``nn.LSTM``."""
        x = x if feed is None else torch.cat([x, feed], dim=-1)
        for layer, params in enumerate(self.layers):
            if layer > 0:
                x = F.dropout(x, self.dropout, self.training)
            h[layer], c[layer] = lstm_step(x, h[layer], c[layer], *params)
            x = h[layer]


def lstm_weights(rnn: nn.LSTM) -> tuple[tuple[Tensor, ...], ...]:
    """Per layer, ``rnn``'s (weight_ih, weight_hh, bias_ih, bias_hh)."""
    return tuple(tuple(getattr(rnn, f"{name}_l{layer}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
                 for layer in range(rnn.num_layers))


def lstm_call(rnn: nn.LSTM, x: Any, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Any, tuple[Tensor, Tensor]]:
    """``rnn(x, hx)`` (``x`` a tensor or a ``PackedSequence``). CPU autocast runs ``nn.LSTM`` in
    its lower precision through oneDNN, which has no bf16 or fp16 LSTM without AVX-512 ("could not
    create a primitive descriptor"): on such a CPU the call runs in fp32, autocast off."""
    device = rnn.weight_hh_l0.device.type
    if device != "cpu" or not torch.is_autocast_enabled(device) or _onednn_lstm_has(torch.get_autocast_dtype(device)):
        return rnn(x, hx)
    with torch.autocast(device, enabled=False):
        x = x._replace(data=x.data.float()) if isinstance(x, PackedSequence) else x.float()
        return rnn(x, None if hx is None else tuple(s.float() for s in hx))


def _onednn_lstm_has(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


def attention_with_weights(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float,
                           is_causal: bool) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention as matmuls and a softmax, with its weights (fp32, also
    under autocast): q (B, heads, T, d), k/v (B, heads, S, d) -> (B, heads, T, d), (B, heads, T, S)."""
    scores = (q / math.sqrt(q.size(-1))) @ k.transpose(-2, -1)
    if is_causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return F.dropout(weights, dropout).to(v.dtype) @ v, weights


class ReferenceOps:
    """Plain PyTorch, operation by operation."""

    def tanh(self, x: Tensor) -> Tensor:
        return torch.tanh(x)

    def dropout(self, x: Tensor, p: float, training: bool) -> Tensor:
        return F.dropout(x, p, training)

    def cast_once(self, x: Tensor) -> Tensor:
        """A tensor every decoding step reads (attention values): autocast casts it at each use."""
        return x

    def additive_score(self, v: Tensor, query: Tensor, keys: Tensor) -> Tensor:
        """``v^T tanh(query + key)`` for every (step, source) pair: v (A,), query (B, T, A), keys
        (B, S, A) -> (B, T, S)."""
        return torch.tanh(query.unsqueeze(2) + keys.unsqueeze(1)) @ v

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, is_causal: bool,
                  need_weights: bool, grouped: bool) -> tuple[Tensor, Tensor | None]:
        """Multi-head attention, q (B, heads, T, d), k/v (B, heads, S, d), mask True = attend ->
        (B, heads, T, d) and, if asked, the weights (B, heads, T, S) (SDPA returns none).
        ``grouped``: the T queries are several beams' over their sentence's shared keys."""
        if need_weights:
            return attention_with_weights(q, k, v, mask, dropout, is_causal)
        return shape_free(q, k, v, mask, dropout, is_causal), None

    def encoder_lstm(self, rnn: nn.LSTM, x: Tensor, src_mask: Tensor, checkpointing: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``rnn`` (batch-first, bidirectional or not) over packed sequences: x (B, S, I) ->
        outputs (B, S, D*h) and the final h and c (B, L, D*h), each layer's directions side by
        side. ``checkpointing``: keep only the input, recompute in the backward pass."""

        def packed(x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            out, (h, c) = lstm_call(rnn, pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.size(1))
            return out, h, c

        lengths = src_mask.sum(1).cpu()
        out, h, c = checkpoint(packed, x, lengths, use_reentrant=False) if checkpointing else packed(x, lengths)
        layers, dirs = rnn.num_layers, 2 if rnn.bidirectional else 1
        # (L*D, B, h) -> (B, L, D*h)
        final = [s.view(layers, dirs, s.size(1), -1).permute(2, 0, 1, 3).reshape(s.size(1), layers, -1) for s in (h, c)]
        return out, final[0], final[1]

    def lstm(self, rnn: nn.LSTM, x: Tensor, hx: tuple[Tensor, Tensor]) -> Tensor:
        """``rnn`` (batch-first) over whole sequences x (B, T, I) from the states ``hx`` (L, B, H)
        each -> the top layer's outputs (B, T, H)."""
        return lstm_call(rnn, x, hx)[0]

    def decoder_lstm(self, rnn: nn.LSTM, emb_size: int) -> LSTMSteps:
        """``rnn`` prepared for stepping, once per sequence; its first layer reads
        ``[embedding (emb_size); feed]``."""
        return LSTMSteps(rnn)

    def log_softmax(self, x: Tensor) -> Tensor:
        """fp32 log-probabilities over the last dimension; ``x`` is the caller's to overwrite."""
        return torch.log_softmax(x, -1, dtype=torch.float32)

    def output_cross_entropy(self, hidden: Tensor, weight: Tensor, target: Tensor, eps: float,
                             not_targets: tuple[int, ...] = (), bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Mean label-smoothed loss of the logits ``hidden @ weight.T + bias`` (N, V) against targets (N,),
        and the mean plain NLL (no gradient, for perplexity). Label smoothing (Szegedy et al. 2016)
        spreads ``eps`` evenly over the entries a target can be: all but ``not_targets`` (padding
        and BOS), as OpenNMT-py leaves padding out; with none left out it is ``F.cross_entropy``'s
        ``label_smoothing``."""
        logits = F.linear(hidden, weight, bias).float()
        nll = F.cross_entropy(logits.detach(), target)
        if not eps or not not_targets:
            return F.cross_entropy(logits, target, label_smoothing=eps), nll
        log_probs = torch.log_softmax(logits, -1)  # (N, V)
        uniform = log_probs.new_ones(log_probs.size(-1))
        uniform[list(smoothed_out(not_targets, log_probs.size(-1)))] = 0
        uniform /= uniform.sum()  # (V,): the smoothed target, 1/|K| on each entry a target can be
        return (1 - eps) * F.nll_loss(log_probs, target) - eps * (log_probs @ uniform).mean(), nll


REFERENCE = ReferenceOps()

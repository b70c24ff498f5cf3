"""The CPU kernels as ``ReferenceOps``' operations (same signatures), and their int8 variant.

``CPUOps`` computes each operation with this package's kernels (``lstm``, ``dropout``,
``attention``, ``sdpa``, ``loss``); ``Int8Ops`` runs the LSTMs' input projections and a decoder's
step matmuls in int8 too (``nmt.kernels.int8``), on weights quantized at first use and kept.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

import nmt.kernels.attention as attention
import nmt.kernels.loss as loss
import nmt.kernels.lstm as lstm
import nmt.kernels.sdpa as sdpa
from nmt.kernels.dropout import dropout
from nmt.kernels.int8 import Int8Linear
from nmt.kernels.reference import ReferenceOps, attention_with_weights, lstm_call


class CPUOps(ReferenceOps):
    """The CPU kernels, operation by operation."""

    def tanh(self, x: Tensor) -> Tensor:
        return lstm.tanh(x)

    def dropout(self, x: Tensor, p: float, training: bool) -> Tensor:
        return dropout(x, p, training)

    def cast_once(self, x: Tensor) -> Tensor:
        """Cast once per sequence to the autocast dtype, not once per step."""
        return lstm.in_autocast_dtype(x)

    def additive_score(self, v: Tensor, query: Tensor, keys: Tensor) -> Tensor:
        return attention.additive_score(v, query, keys)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, is_causal: bool,
                  need_weights: bool, grouped: bool) -> tuple[Tensor, Tensor | None]:
        """Matmuls and a softmax where they beat SDPA (a decoding step's queries), else SDPA in
        fp32 under CPU autocast."""
        if need_weights or sdpa.eager_for(q, grouped):
            return attention_with_weights(q, k, v, mask, dropout, is_causal)
        return sdpa.sdpa(q, k, v, mask, dropout, is_causal), None

    def encoder_lstm(self, rnn: nn.LSTM, x: Tensor, src_mask: Tensor, checkpointing: bool) -> tuple[Tensor, Tensor, Tensor]:
        return lstm.encoder(rnn, x, src_mask, checkpointing)

    def lstm(self, rnn: nn.LSTM, x: Tensor, hx: tuple[Tensor, Tensor]) -> Tensor:
        """``nn.LSTM`` itself: over unpadded whole sequences, torch's oneDNN kernel is the CPU kernel."""
        return lstm_call(rnn, x, hx)[0]

    def decoder_lstm(self, rnn: nn.LSTM, emb_size: int) -> lstm.StepsOnWeights:
        return lstm.StepsOnWeights(rnn, lstm.step_weights(rnn, emb_size))

    def log_softmax(self, x: Tensor) -> Tensor:
        """In place for fp32 (the CPU kernel's last pass is elementwise per row: safe); bf16 by
        ``log_softmax`` with an fp32 output, measured faster than converting first."""
        if x.dtype != torch.float32:
            return torch.log_softmax(x, -1, dtype=torch.float32)
        return torch._log_softmax(x, -1, False, out=x)

    def output_cross_entropy(self, hidden: Tensor, weight: Tensor, target: Tensor, eps: float,
                             not_targets: tuple[int, ...] = (), bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return loss.output_cross_entropy(hidden, weight, target, eps, not_targets=not_targets, bias=bias)


class Int8Ops(CPUOps):
    """The CPU kernels with the LSTMs' matmuls in int8 (inference only; ``nn.Linear`` layers are
    replaced by ``Int8Linear`` in the model itself). Each LSTM's weights are quantized at its first
    use and kept, keyed by the ``nn.LSTM``."""

    def __init__(self) -> None:
        self.quantized: dict[nn.LSTM, Any] = {}

    def _quantized(self, rnn: nn.LSTM, make: Callable[[], Any]) -> Any:
        if rnn not in self.quantized:
            with torch.no_grad(), torch.autocast(rnn.weight_hh_l0.device.type, enabled=False):
                self.quantized[rnn] = make()
        return self.quantized[rnn]

    def encoder_lstm(self, rnn: nn.LSTM, x: Tensor, src_mask: Tensor, checkpointing: bool) -> tuple[Tensor, Tensor, Tensor]:
        """The input projections in int8; the recurrence stays in floating point."""
        inputs = self._quantized(rnn, lambda: [Int8Linear(*lstm.input_weights(rnn, layer)) for layer in range(rnn.num_layers)])
        return lstm.encoder(rnn, x, src_mask, checkpointing, inputs)

    def decoder_lstm(self, rnn: nn.LSTM, emb_size: int) -> lstm.StepsOnWeights:
        return lstm.StepsOnWeights(rnn, self._quantized(rnn, lambda: lstm.quantized(lstm.step_weights(rnn, emb_size))))


CPU = CPUOps()

"""LSTM encoder and decoder: plain (Sutskever et al. 2014; Cho et al. 2014), Bahdanau et al. 2015
and Luong et al. 2015, chosen by the decoder's ``attention`` and ``input_feeding``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from nmt.specials import PAD
from nmt.models.dropout import Dropout, dropout

FEEDS = ("none", "context", "attentional")


def in_autocast_dtype(x: Tensor) -> Tensor:
    """``x`` in the autocast dtype when autocast is on: a weight (or the attention memory) used at
    every time step is cast once per sequence, not once per step (autocast caches only leaf
    parameters)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class _SumBiases(torch.autograd.Function):
    """``b_ih + b_hh`` whose two gradients are separate tensors. Autograd hands an addition's one
    incoming gradient to both inputs, so the two parameters' ``.grad`` would share storage and
    every in-place gradient update (clipping, accumulation over batches) would hit it twice."""

    @staticmethod
    def forward(ctx, b_ih: Tensor, b_hh: Tensor) -> Tensor:
        return b_ih + b_hh

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, grad.clone()


def sum_biases(b_ih: Tensor, b_hh: Tensor) -> Tensor:
    return _SumBiases.apply(b_ih, b_hh)


def tanh(x: Tensor) -> Tensor:
    """``tanh x = 2 sigmoid(2x) - 1`` on CPUs, in at least fp32 (in bf16 the subtraction would
    cancel small values to 0): torch's CPU tanh is ~6x slower than its sigmoid. Used by the
    attentional layer, the bridge and, when decoding, ``lstm_cell``; GPUs keep ``torch.tanh``."""
    if not x.is_cpu:
        return torch.tanh(x)
    y = x.to(cell_dtype(x.dtype))
    return (torch.sigmoid(2 * y) * 2).sub_(1).to(x.dtype)


def affine(add: Tensor, x: Tensor, w: Any) -> Tensor:
    """``add + x @ w`` for x (..., in) and a (in, out) matrix ``w``, or an int8 one
    (``nmt.quantize.Int8Linear`` of the transposed matrix) once ``RNNDecoder.quantize_steps``
    has run; ``add`` is a bias, or per row for a 2-D ``x``."""
    if not isinstance(w, Tensor):
        return w(x).add_(add)
    return torch.addmm(add, x, w) if x.dim() == 2 else F.linear(x, w.t(), add)


def lstm_cell(gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """LSTM state update from pre-activations (..., 4H) in torch's gate order i, f, g, o. The
    cell ``c`` keeps its own (fp32) precision; ``h`` comes out in the gates' dtype, the one its
    consumers (the next step's matmuls, attention) compute in, so it is cast once, not by each.

    Without gradients (decoding) the two tanh are the sigmoid-based ``tanh``: the cell takes half
    the time at a beam search's 500 rows. Training keeps ``torch.tanh``: with the backward pass
    and the casts of bf16 gates, the extra ops measured 5-15% slower per step at 2 threads."""
    i, f, g, o = gates.chunk(4, dim=-1)
    act = torch.tanh if torch.is_grad_enabled() else tanh
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * act(g)
    return (torch.sigmoid(o) * act(c)).to(gates.dtype), c


def cell_dtype(dtype: torch.dtype) -> torch.dtype:
    """The LSTM cell state's dtype: at least fp32, also under bf16/fp16 autocast."""
    return torch.promote_types(dtype, torch.float32)


class RNNEncoder(nn.Module):
    """Multi-layer (bidirectional) LSTM; padding never changes a sentence's encoding.

    With ``bidirectional`` each direction has ``hidden_size // 2`` units, so outputs and final
    states are ``hidden_size`` wide either way: ``enc_out`` (B, S, H), ``final_h``/``final_c``
    (B, L, H) with the two directions' last states side by side.

    The recurrence runs on ``self.rnn``'s weights one position at a time, both directions in
    one batched matmul, and a sentence's state only advances on its own tokens (the backward
    direction starts at its last token); the input projections of all positions are one matmul
    per layer. This computes what ``nn.LSTM`` computes on packed sequences, without the packed
    path's per-step full-size gradient buffers. With gradient checkpointing each layer keeps only
    its input and recomputes its steps in the backward pass. ``quantize_steps`` (inference) runs
    those input projections in int8.
    """

    def __init__(
        self,
        vocab_size: int,
        emb_size: int,
        hidden_size: int,
        num_layers: int = 2,
        dropout: float = 0.0,
        bidirectional: bool = True,
    ) -> None:
        super().__init__()
        if bidirectional and hidden_size % 2:
            raise ValueError(f"a bidirectional RNNEncoder needs an even hidden_size, got {hidden_size}")
        self.num_directions = 2 if bidirectional else 1
        self.final_state_layers = num_layers
        self.gradient_checkpointing = False
        self.embed = nn.Embedding(vocab_size, emb_size, padding_idx=PAD)
        self.dropout = Dropout(dropout)
        self.rnn = nn.LSTM(
            emb_size,
            hidden_size // self.num_directions,
            num_layers=num_layers,
            dropout=dropout if num_layers > 1 else 0.0,
            bidirectional=bidirectional,
            batch_first=True,
        )
        self.int8_inputs: list[Any] | None = None

    def _params(self, name: str, layer: int) -> list[Tensor]:
        """``self.rnn``'s parameter ``name`` (e.g. ``weight_ih``) of the layer, per direction."""
        return [getattr(self.rnn, f"{name}_l{layer}{s}") for s in ("", "_reverse")[: self.num_directions]]

    def _input_weights(self, layer: int) -> tuple[Tensor, Tensor]:
        """The layer's input weights of every direction stacked (D*4h, I) and the summed biases."""
        bias_ih, bias_hh = (torch.cat(self._params(name, layer)) for name in ("bias_ih", "bias_hh"))
        return torch.cat(self._params("weight_ih", layer)), sum_biases(bias_ih, bias_hh)

    def quantize_steps(self) -> None:
        """Project the inputs of every layer with int8 matmuls from now on (``nmt.quantize``;
        inference only). The recurrence stays in floating point."""
        from nmt.quantize import Int8Linear

        self.int8_inputs = [Int8Linear(*self._input_weights(layer)) for layer in range(self.rnn.num_layers)]

    def _layer(self, x: Tensor, mask: Tensor, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """One layer, every direction: x (B, S, I), mask (S, D, B, 1) in each direction's time
        order -> outputs (B, S, D*h) (zero on padding), final h and c (B, D*h)."""
        batch, length, dirs = x.size(0), x.size(1), self.num_directions
        if self.int8_inputs is not None:
            x_proj = self.int8_inputs[layer](x.transpose(0, 1))  # (S, B, D*4h)
        else:
            x_proj = F.linear(x.transpose(0, 1), *self._input_weights(layer))
        x_proj = x_proj.view(length, batch, dirs, -1).transpose(1, 2)  # (S, D, B, 4h)
        if dirs == 2:  # the backward direction reads the positions last to first
            x_proj = torch.stack([x_proj[:, 0], x_proj[:, 1].flip(0)], dim=1)
        w_hh = in_autocast_dtype(torch.stack(self._params("weight_hh", layer)).transpose(1, 2))  # (D, h, 4h)
        h = x.new_zeros(dirs, batch, w_hh.size(1), dtype=w_hh.dtype)  # (D, B, h), the matmuls' dtype
        c = x.new_zeros(dirs, batch, w_hh.size(1), dtype=cell_dtype(x.dtype))
        outputs = []
        for x_t, m_t in zip(x_proj.unbind(0), mask.unbind(0)):
            h_new, c_new = lstm_cell(torch.baddbmm(x_t, h, w_hh), c)
            h, c = torch.where(m_t, h_new, h), torch.where(m_t, c_new, c)  # padding keeps the state
            outputs.append(h)
        out = torch.stack(outputs) * mask  # (S, D, B, h), zero on padding
        if dirs == 2:
            out = torch.stack([out[:, 0], out[:, 1].flip(0)], dim=1)
        out = out.permute(2, 0, 1, 3).reshape(batch, length, -1)  # (B, S, D*h)
        return out, h.transpose(0, 1).reshape(batch, -1), c.transpose(0, 1).reshape(batch, -1)

    def forward(self, src: Tensor, src_mask: Tensor) -> dict[str, Tensor]:
        mask = src_mask.t().unsqueeze(-1)  # (S, B, 1)
        mask = torch.stack([mask, mask.flip(0)][: self.num_directions], dim=1)  # (S, D, B, 1)
        x = self.dropout(self.embed(src))  # (B, S, E)
        final_h, final_c = [], []
        for layer in range(self.rnn.num_layers):
            if layer > 0:  # between layers, as nn.LSTM
                x = dropout(x, self.rnn.dropout, self.training)
            if self.gradient_checkpointing and self.training:  # keep only each layer's input
                x, h, c = checkpoint(self._layer, x, mask, layer, use_reentrant=False)
            else:
                x, h, c = self._layer(x, mask, layer)
            final_h.append(h)
            final_c.append(c)
        return {"enc_out": self.dropout(x), "src_mask": src_mask, "final_h": torch.stack(final_h, 1), "final_c": torch.stack(final_c, 1)}


@dataclass(frozen=True)
class StepWeights:
    """``RNNDecoder._weights()``, kept in the decoder's memory; not a dict, list or tuple, so
    ``nmt.models.base.select`` leaves it alone when it reorders the batch. Each matrix is applied
    as ``x @ w`` (see ``affine``)."""

    emb: Any
    bias: Tensor
    layers: list[tuple[Any, Tensor]]


class RNNDecoder(nn.Module):
    """LSTM decoder; its wiring follows the papers:

    - ``attention: null`` (``input_feeding: none``): the source reaches the decoder only through
      its initial state, the encoder's final state (the fixed-vector bottleneck).
    - ``input_feeding: context`` (Bahdanau et al. 2015, eq. 4-6): the previous state
      ``s_{i-1}`` attends, and the context ``c_i`` enters the recurrence with ``y_{i-1}``.
    - ``input_feeding: attentional`` (Luong et al. 2015, sec. 3.3): the new state ``h_t`` attends;
      the attentional vector ``h~_t = tanh(W_c [c_t; h_t])`` (eq. 5) predicts the word and is fed to
      the next step. ``input_feeding: none`` with attention drops that feed, so teacher-forced
      training runs the LSTM over the whole sequence in one call.

    Attention decoders predict from ``tanh(W_c [c; h])``; the plain decoder from ``h``.

    Step by step (with a feed, and in ``decode_step``) the LSTM runs on ``self.rnn``'s own
    weights, so the parameters stay those of ``nn.LSTM``: the embedding part of the first layer's
    input projection is one matmul over all steps, and a step costs one matmul per layer,
    ``[h; input] @ [W_hh W_ih]^T`` (the input of the first layer being the feed alone).
    """

    def __init__(
        self,
        vocab_size: int,
        emb_size: int,
        hidden_size: int,
        num_layers: int = 2,
        dropout: float = 0.0,
        attention: Callable[..., nn.Module] | None = None,
        input_feeding: str = "none",
        memory_size: int | None = None,
    ) -> None:
        super().__init__()
        if input_feeding not in FEEDS:
            raise ValueError(f"input_feeding must be one of {FEEDS}, got {input_feeding!r}")
        if attention is None and input_feeding != "none":
            raise ValueError(f"input_feeding={input_feeding!r} needs an attention; set input_feeding: none")
        memory_size = memory_size or hidden_size
        self.input_feeding = input_feeding
        self.needs_init_state = num_layers
        self.embed = nn.Embedding(vocab_size, emb_size, padding_idx=PAD)
        self.dropout = Dropout(dropout)
        feed_size = {"none": 0, "context": memory_size, "attentional": hidden_size}[input_feeding]
        self.rnn = nn.LSTM(
            emb_size + feed_size,
            hidden_size,
            num_layers=num_layers,
            dropout=dropout if num_layers > 1 else 0.0,
            batch_first=True,
        )
        self.attention = attention(query_size=hidden_size, key_size=memory_size) if attention else None
        self.att_out = nn.Linear(memory_size + hidden_size, hidden_size, bias=False) if attention else None
        self.out = nn.Linear(hidden_size, vocab_size, bias=False)
        self.int8_weights: StepWeights | None = None

    def quantize_steps(self) -> None:
        """Step with int8 matmuls from now on (``nmt.quantize``; inference only)."""
        from nmt.quantize import Int8Linear

        emb, bias, layers = self._weights()
        self.int8_weights = StepWeights(Int8Linear(emb.t()), bias, [(Int8Linear(w.t()), b) for w, b in layers])

    def step_weights(self) -> StepWeights:
        return self.int8_weights or StepWeights(*self._weights())

    def prepare_memory(self, memory: dict[str, Tensor]) -> dict[str, Any]:
        """What every step reuses: the LSTM's step weights (cast once under autocast; not when
        teacher-forced training calls ``nn.LSTM`` once), and with attention the projected keys
        and ``enc_out`` (the values) in the matmul dtype."""
        if self.input_feeding != "none" or not self.training:
            memory = {**memory, "weights": self.step_weights()}
        if self.attention is None:
            return memory
        values = in_autocast_dtype(memory["enc_out"])
        return {**memory, "enc_out": values, "keys": self.attention.project_keys(values)}

    def init_state(self, memory: dict[str, Tensor]) -> dict[str, Any]:
        state = {"h": memory["final_h"], "c": memory["final_c"]}  # (B, L, H)
        if self.input_feeding == "attentional":
            state["feed"] = memory["final_h"].new_zeros(memory["final_h"].shape[0], self.rnn.hidden_size)
        return state

    def _attend(self, query: Tensor, memory: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return self.attention(query, memory["keys"], memory["enc_out"], memory["src_mask"])

    def _output(self, h: Tensor, context: Tensor | None) -> Tensor:
        if context is None:
            return self.dropout(h)
        return self.dropout(tanh(self.att_out(torch.cat([context, h], dim=-1))))

    def _weights(self) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
        """``self.rnn``'s weights for stepping: the embedding columns of the first layer's input
        weight, transposed (E, 4H), its summed bias (4H,), and per layer the transposed weight
        applied each step to ``[h; input]`` (the input being the feed in the first layer; h alone
        without a feed), one matmul instead of two, with the layer's summed bias."""
        emb_size = self.embed.embedding_dim
        layers = []
        for layer in range(self.rnn.num_layers):
            w_ih, w_hh, b_ih, b_hh = (getattr(self.rnn, f"{name}_l{layer}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
            if layer == 0:
                w_emb, w_ih = w_ih[:, :emb_size], w_ih[:, emb_size:]
            w = torch.cat([w_hh, w_ih], dim=1) if w_ih.size(1) else w_hh  # (4H, H + I)
            layers.append((in_autocast_dtype(w.t()), in_autocast_dtype(sum_biases(b_ih, b_hh))))
        return w_emb.t(), layers[0][1], layers

    def _recur(self, x_proj: Tensor, feed: Tensor | None, h: list[Tensor], c: list[Tensor], layers) -> None:
        """One LSTM step through every layer (torch's gate order i, f, g, o), updating the
        per-layer states ``h``/``c`` (lists of (B, H)) in place. ``x_proj`` (B, 4H) is the first
        layer's embedding projection plus bias; dropout between layers as in ``nn.LSTM``."""
        x = feed
        for layer, (w, bias) in enumerate(layers):
            if layer > 0 and self.rnn.dropout:
                x = dropout(x, self.rnn.dropout, self.training)
            hx = h[layer] if x is None else torch.cat([h[layer], x], dim=-1)  # (B, H + I)
            h[layer], c[layer] = lstm_cell(affine(x_proj if layer == 0 else bias, hx, w), c[layer])
            x = h[layer]

    def _step(self, x_proj: Tensor, memory: dict[str, Any], state: dict[str, Any]) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x_proj (B, 4H) -> top state (B, H), context (B, Hk) | None, attention (B, S) | None;
        ``state`` (lists ``h``/``c`` and ``feed``) is updated in place."""
        context = attn = None
        if self.input_feeding == "context":
            context, attn = self._attend(state["h"][-1], memory)
            state["feed"] = context
        self._recur(x_proj, state.get("feed"), state["h"], state["c"], memory["weights"].layers)
        h_top = state["h"][-1]
        if self.attention is not None and self.input_feeding != "context":
            context, attn = self._attend(h_top, memory)
        if self.input_feeding == "attentional":
            state["feed"] = self._output(h_top, context)
        return h_top, context, attn

    def decode_step(
        self, prev: Tensor, memory: dict[str, Tensor], state: dict[str, Any], need_attn: bool = False
    ) -> tuple[Tensor, dict[str, Any], Tensor | None]:
        if "weights" not in memory:  # encoded in training mode by a decoder that does not step there
            memory = {**memory, "weights": self.step_weights()}
        weights = memory["weights"]
        x_proj = affine(weights.bias, self.dropout(self.embed(prev)), weights.emb)  # (B, 4H)
        step_state = {"h": list(state["h"].unbind(1)), "c": list(state["c"].unbind(1)), "feed": state.get("feed")}
        h_top, context, attn = self._step(x_proj, memory, step_state)
        output = step_state["feed"] if self.input_feeding == "attentional" else self._output(h_top, context)
        new_state = {"h": torch.stack(step_state["h"], 1), "c": torch.stack(step_state["c"], 1)}
        if self.input_feeding == "attentional":
            new_state["feed"] = output
        return self.out(output), new_state, attn

    def _run(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced outputs (B, T, H) and attention (B, T, S) or None."""
        emb = self.dropout(self.embed(tgt_in))  # (B, T, E)
        state = self.init_state(memory)
        if self.input_feeding == "none":  # no recurrence through attention: one LSTM call
            hc = tuple(state[k].transpose(0, 1).to(emb.dtype).contiguous() for k in ("h", "c"))
            h, _ = self.rnn(emb, hc)  # (B, T, H)
            if self.attention is None:
                return self._output(h, None), None
            context, attn = self._attend(h, memory)  # (B, T, Hk), (B, T, S)
            return self._output(h, context), attn
        weights = memory["weights"]
        x_proj = affine(weights.bias, emb.transpose(0, 1), weights.emb)  # (T, B, 4H), all steps at once
        state = {"h": list(state["h"].unbind(1)), "c": list(state["c"].unbind(1)), "feed": state.get("feed")}
        tops, contexts, attns = [], [], []
        for x_t in x_proj.unbind(0):  # unbind, not x_proj[t]: one backward node, no per-step zeros
            h_top, context, attn = self._step(x_t, memory, state)
            # Luong: the output is the feed, computed in the step; Bahdanau: it does not feed
            # back, so the output layer runs once over all steps below.
            tops.append(state["feed"] if self.input_feeding == "attentional" else h_top)
            contexts.append(context)
            attns.append(attn)
        attn = torch.stack(attns, 1)  # (B, T, S)
        if self.input_feeding == "attentional":
            return torch.stack(tops, 1), attn
        return self._output(torch.stack(tops, 1), torch.stack(contexts, 1)), attn

    def features(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> Tensor:
        """Teacher-forced outputs (B, T, H), the input of ``self.out``."""
        return self._run(tgt_in, memory)[0]

    def forward(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> Tensor:
        return self.out(self.features(tgt_in, memory))  # (B, T, V)

    def cross_attention(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> Tensor | None:
        attn = self._run(tgt_in, memory)[1]
        return None if attn is None else attn[:, None, None]  # (B, 1, 1, T, S)

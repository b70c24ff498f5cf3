"""LSTM encoder and decoder: plain (Sutskever et al. 2014; Cho et al. 2014), Bahdanau et al. 2015
and Luong et al. 2015, chosen by the decoder's ``attention`` and ``input_feeding``.

The code here is the reference: ``nn.LSTM`` over packed sequences, a decoder step on the LSTM's
weights as the equations read. With the CPU kernels on (``kernels``, ``nmt.kernels``), the same
parameters run ``nmt.kernels.lstm``'s stepped recurrence instead.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.checkpoint import checkpoint

from nmt.kernels import Switchable
from nmt.kernels import lstm as fast
from nmt.kernels.dropout import Dropout, dropout
from nmt.specials import PAD

FEEDS = ("none", "context", "attentional")


def lstm_step(x: Tensor | None, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor) -> tuple[Tensor, Tensor]:
    """One LSTM step (torch's gate order i, f, g, o): ``x`` (B, I) or None (no input), h/c (B, H)."""
    gates = F.linear(h, w_hh, b_hh) + (b_ih if x is None else F.linear(x, w_ih, b_ih))
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


class RNNEncoder(Switchable, nn.Module):
    """Multi-layer (bidirectional) ``nn.LSTM`` over packed sequences: padding never changes a
    sentence's encoding.

    With ``bidirectional`` each direction has ``hidden_size // 2`` units, so outputs and final
    states are ``hidden_size`` wide either way: ``enc_out`` (B, S, H), ``final_h``/``final_c``
    (B, L, H) with the two directions' last states side by side. With gradient checkpointing the
    LSTM keeps only its input and recomputes in the backward pass (per layer with the CPU
    kernel, ``nmt.kernels.lstm.encoder_layer``). ``quantize_steps`` (inference, CPU kernels)
    runs the input projections in int8.
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

    def quantize_steps(self) -> None:
        """Project the inputs of every layer with int8 matmuls from now on (``nmt.kernels.int8``;
        inference only, CPU kernels). The recurrence stays in floating point."""
        from nmt.kernels.int8 import Int8Linear

        self.int8_inputs = [Int8Linear(*fast.input_weights(self.rnn, layer)) for layer in range(self.rnn.num_layers)]

    def _packed(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, (h, c) = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.size(1))
        return out, h, c

    def _reference(self, x: Tensor, src_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        lengths = src_mask.sum(1).cpu()
        if self.gradient_checkpointing and self.training:
            out, h, c = checkpoint(self._packed, x, lengths, use_reentrant=False)
        else:
            out, h, c = self._packed(x, lengths)
        layers, dirs = self.rnn.num_layers, self.num_directions
        # (L*D, B, h) -> (B, L, D*h): each layer's directions side by side
        final = [s.view(layers, dirs, s.size(1), -1).permute(2, 0, 1, 3).reshape(s.size(1), layers, -1) for s in (h, c)]
        return out, final[0], final[1]

    def _stepped(self, x: Tensor, src_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mask = fast.direction_masks(src_mask, self.num_directions)  # (S, D, B, 1)
        final_h, final_c = [], []
        for layer in range(self.rnn.num_layers):
            if layer > 0:  # between layers, as nn.LSTM
                x = dropout(x, self.rnn.dropout, self.training)
            int8 = self.int8_inputs[layer] if self.int8_inputs is not None else None
            if self.gradient_checkpointing and self.training:  # keep only each layer's input
                x, h, c = checkpoint(fast.encoder_layer, self.rnn, x, mask, layer, int8, use_reentrant=False)
            else:
                x, h, c = fast.encoder_layer(self.rnn, x, mask, layer, int8)
            final_h.append(h)
            final_c.append(c)
        return x, torch.stack(final_h, 1), torch.stack(final_c, 1)

    def forward(self, src: Tensor, src_mask: Tensor) -> dict[str, Tensor]:
        x = self.dropout(self.embed(src))  # (B, S, E)
        run = self._stepped if self.fast(x) or self.int8_inputs is not None else self._reference
        out, final_h, final_c = run(x, src_mask)
        return {"enc_out": self.dropout(out), "src_mask": src_mask, "final_h": final_h, "final_c": final_c}


class RNNDecoder(Switchable, nn.Module):
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
    weights (``lstm_step``), so the parameters stay those of ``nn.LSTM``; with the CPU kernels
    on, ``nmt.kernels.lstm.decoder_step`` computes the same step.
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
        self.int8_weights: fast.StepWeights | None = None

    def quantize_steps(self) -> None:
        """Step with int8 matmuls from now on (``nmt.kernels.int8``; inference only, CPU kernels)."""
        self.int8_weights = fast.quantized(fast.step_weights(self.rnn, self.embed.embedding_dim))

    def _step_weights(self, x: Tensor) -> fast.StepWeights | None:
        """The CPU kernel's step weights (cast once per sequence under autocast), or None for the
        reference step."""
        if self.int8_weights is not None:
            return self.int8_weights
        return fast.step_weights(self.rnn, self.embed.embedding_dim) if self.fast(x) else None

    def prepare_memory(self, memory: dict[str, Tensor]) -> dict[str, Any]:
        """What every step reuses: with the CPU kernels, the LSTM's step weights (not when
        teacher-forced training calls ``nn.LSTM`` once) and ``enc_out`` (the values) cast once to
        the matmul dtype; with attention the projected keys."""
        weights = None
        if self.input_feeding != "none" or not self.training:
            weights = self._step_weights(memory["enc_out"])
        if weights is not None:
            memory = {**memory, "weights": weights}
        if self.attention is None:
            return memory
        values = fast.in_autocast_dtype(memory["enc_out"]) if self.fast(memory["enc_out"]) else memory["enc_out"]
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
        x = self.att_out(torch.cat([context, h], dim=-1))
        return self.dropout(fast.tanh(x) if self.fast(x) else torch.tanh(x))

    def _recur(self, x: Tensor, feed: Tensor | None, h: list[Tensor], c: list[Tensor], weights: fast.StepWeights | None) -> None:
        """One LSTM step through every layer, updating the per-layer states ``h``/``c`` (lists of
        (B, H)) in place; ``x`` is the step's embedding (B, E), or with the CPU kernels' step
        ``weights`` its projection (B, 4H). Dropout between layers as in ``nn.LSTM``."""
        if weights is not None:
            fast.decoder_step(x, feed, h, c, weights, self.rnn.dropout, self.training)
            return
        x = x if feed is None else torch.cat([x, feed], dim=-1)
        for layer in range(self.rnn.num_layers):
            if layer > 0:
                x = F.dropout(x, self.rnn.dropout, self.training)
            params = (getattr(self.rnn, f"{name}_l{layer}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
            h[layer], c[layer] = lstm_step(x, h[layer], c[layer], *params)
            x = h[layer]

    def _step(self, x: Tensor, memory: dict[str, Any], state: dict[str, Any]) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x (B, E) or (B, 4H) (see ``_recur``) -> top state (B, H), context (B, Hk) | None,
        attention (B, S) | None; ``state`` (lists ``h``/``c`` and ``feed``) is updated in place."""
        context = attn = None
        if self.input_feeding == "context":
            context, attn = self._attend(state["h"][-1], memory)
            state["feed"] = context
        self._recur(x, state.get("feed"), state["h"], state["c"], memory.get("weights"))
        h_top = state["h"][-1]
        if self.attention is not None and self.input_feeding != "context":
            context, attn = self._attend(h_top, memory)
        if self.input_feeding == "attentional":
            state["feed"] = self._output(h_top, context)
        return h_top, context, attn

    def _inputs(self, emb: Tensor, memory: dict[str, Any]) -> Tensor:
        """The steps' inputs: the embeddings, or with the CPU kernels their projections, one
        matmul for all steps."""
        weights = memory.get("weights")
        return emb if weights is None else fast.affine(weights.bias, emb, weights.emb)

    def decode_step(
        self, prev: Tensor, memory: dict[str, Tensor], state: dict[str, Any], need_attn: bool = False
    ) -> tuple[Tensor, dict[str, Any], Tensor | None]:
        if "weights" not in memory:  # encoded in training, which calls nn.LSTM once, or the reference
            weights = self._step_weights(memory["enc_out"])
            memory = memory if weights is None else {**memory, "weights": weights}
        x = self._inputs(self.dropout(self.embed(prev)), memory)
        step_state = {"h": list(state["h"].unbind(1)), "c": list(state["c"].unbind(1)), "feed": state.get("feed")}
        h_top, context, attn = self._step(x, memory, step_state)
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
        xs = self._inputs(emb.transpose(0, 1), memory)  # (T, B, E | 4H)
        state = {"h": list(state["h"].unbind(1)), "c": list(state["c"].unbind(1)), "feed": state.get("feed")}
        tops, contexts, attns = [], [], []
        for x_t in xs.unbind(0):  # unbind, not xs[t]: one backward node, no per-step zeros
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

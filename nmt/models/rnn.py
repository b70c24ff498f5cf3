"""LSTM encoder and decoder: plain (Sutskever et al. 2014; Cho et al. 2014), Bahdanau et al. 2015
and Luong et al. 2015, chosen by the decoder's ``attention`` and ``input_feeding``."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from nmt.data.tokenizer import PAD

FEEDS = ("none", "context", "attentional")


class RNNEncoder(nn.Module):
    """Multi-layer LSTM over packed sequences, so padding never changes a sentence's encoding.

    With ``bidirectional`` each direction has ``hidden_size // 2`` units, so outputs and final
    states are ``hidden_size`` wide either way: ``enc_out`` (B, S, H), ``final_h``/``final_c``
    (B, L, H) with the two directions' last states side by side.
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
        self.embed = nn.Embedding(vocab_size, emb_size, padding_idx=PAD)
        self.dropout = nn.Dropout(dropout)
        self.rnn = nn.LSTM(
            emb_size,
            hidden_size // self.num_directions,
            num_layers=num_layers,
            dropout=dropout if num_layers > 1 else 0.0,
            bidirectional=bidirectional,
            batch_first=True,
        )

    def forward(self, src: Tensor, src_mask: Tensor) -> dict[str, Tensor]:
        lengths = src_mask.sum(1).cpu()
        packed = pack_padded_sequence(self.dropout(self.embed(src)), lengths, batch_first=True, enforce_sorted=False)
        out, (h, c) = self.rnn(packed)
        enc_out, _ = pad_packed_sequence(out, batch_first=True, total_length=src.size(1))  # (B, S, H)

        def layers(state: Tensor) -> Tensor:  # (L*D, B, H/D) -> (B, L, H)
            num_layers, batch = self.final_state_layers, state.size(1)
            state = state.view(num_layers, self.num_directions, batch, -1)
            return state.permute(2, 0, 1, 3).reshape(batch, num_layers, -1)

        return {"enc_out": self.dropout(enc_out), "src_mask": src_mask, "final_h": layers(h), "final_c": layers(c)}


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
        self.dropout = nn.Dropout(dropout)
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

    def prepare_memory(self, memory: dict[str, Tensor]) -> dict[str, Tensor]:
        """Project the attention keys once per sentence."""
        if self.attention is None:
            return memory
        return {**memory, "keys": self.attention.project_keys(memory["enc_out"])}

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
        return self.dropout(torch.tanh(self.att_out(torch.cat([context, h], dim=-1))))

    def _step(self, emb: Tensor, memory: dict[str, Tensor], state: dict[str, Any]) -> tuple[Tensor, dict, Tensor | None]:
        """emb (B, E) -> output vector (B, H), new state, attention (B, S) or None."""
        context = attn = None
        if self.input_feeding == "context":
            context, attn = self._attend(state["h"][:, -1], memory)
            rnn_in = torch.cat([emb, context], dim=-1)
        elif self.input_feeding == "attentional":
            rnn_in = torch.cat([emb, state["feed"]], dim=-1)
        else:
            rnn_in = emb
        hc = (state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous())  # (L, B, H)
        out, (h, c) = self.rnn(rnn_in.unsqueeze(1), hc)
        h_top = out[:, 0]  # (B, H)
        if self.attention is not None and self.input_feeding != "context":
            context, attn = self._attend(h_top, memory)
        output = self._output(h_top, context)
        new_state = {"h": h.transpose(0, 1), "c": c.transpose(0, 1)}
        if self.input_feeding == "attentional":
            new_state["feed"] = output
        return output, new_state, attn

    def decode_step(
        self, prev: Tensor, memory: dict[str, Tensor], state: dict[str, Any], need_attn: bool = False
    ) -> tuple[Tensor, dict[str, Any], Tensor | None]:
        output, state, attn = self._step(self.dropout(self.embed(prev)), memory, state)
        return self.out(output), state, attn

    def _run(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced outputs (B, T, H) and attention (B, T, S) or None."""
        emb = self.dropout(self.embed(tgt_in))  # (B, T, E)
        state = self.init_state(memory)
        if self.input_feeding == "none":  # no recurrence through attention: one LSTM call
            hc = (state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous())
            h, _ = self.rnn(emb, hc)  # (B, T, H)
            if self.attention is None:
                return self._output(h, None), None
            context, attn = self._attend(h, memory)  # (B, T, Hk), (B, T, S)
            return self._output(h, context), attn
        outputs, attns = [], []
        for t in range(tgt_in.size(1)):
            output, state, attn = self._step(emb[:, t], memory, state)
            outputs.append(output)
            attns.append(attn)
        return torch.stack(outputs, 1), torch.stack(attns, 1)

    def forward(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> Tensor:
        return self.out(self._run(tgt_in, memory)[0])  # (B, T, V)

    def cross_attention(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> Tensor | None:
        attn = self._run(tgt_in, memory)[1]
        return None if attn is None else attn[:, None, None]  # (B, 1, 1, T, S)


"""LSTM encoder and decoder: plain (Sutskever et al. 2014; Cho et al. 2014), Bahdanau et al. 2015
and Luong et al. 2015, chosen by the decoder's ``attention`` and ``input_feeding``.

The wiring here follows the papers; the LSTM itself runs through the model's kernels
(``nmt.kernels``): ``nn.LSTM`` over packed sequences and a step on its weights as the equations
read (``nmt.kernels.reference``), or the same parameters through ``nmt.kernels.lstm``'s stepped
recurrence.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from nmt.kernels import UsesKernels
from nmt.kernels.reference import LSTMSteps, cell_dtype, lstm_weights
from nmt.models.dropout import Dropout
from nmt.specials import PAD

FEEDS = ("none", "context", "attentional")
OUTPUTS = ("tanh", "maxout")
INITIAL_STATES = ("final", "tanh")


def reverse_words(x: Tensor, mask: Tensor) -> Tensor:
    """Each row's unpadded positions in reverse order, padding where it was: x (B, S, D), mask
    (B, S) true on words (left-aligned). Its own inverse."""
    positions = torch.arange(x.size(1), device=x.device)
    reversed_ = mask.sum(1, keepdim=True) - 1 - positions  # (B, S); negative on padding
    index = torch.where(reversed_ >= 0, reversed_, positions)
    return x.gather(1, index.unsqueeze(-1).expand_as(x))


class RNNEncoder(UsesKernels, nn.Module):
    """Multi-layer (bidirectional) ``nn.LSTM`` over packed sequences: padding never changes a
    sentence's encoding.

    With ``bidirectional`` each direction has ``hidden_size // 2`` units, so outputs and final
    states are ``hidden_size`` wide either way: ``enc_out`` (B, S, H), ``final_h``/``final_c``
    (B, L, H) with the two directions' last states side by side. With gradient checkpointing the
    LSTM keeps only its input and recomputes in the backward pass (per layer with the CPU
    kernel, ``nmt.kernels.lstm.encoder_layer``).

    ``reverse``: each sentence is read last word first (Sutskever et al. 2014, sec. 3.3), so its
    first words are the last the final state saw; the outputs are put back in source order, so
    attention and alignments still index source positions.
    """

    traceable = False  # torch.compile does not trace nn.LSTM (Seq2Seq.compile_features)

    def __init__(
        self,
        vocab_size: int,
        emb_size: int,
        hidden_size: int,
        num_layers: int = 2,
        dropout: float = 0.0,
        bidirectional: bool = True,
        reverse: bool = False,
    ) -> None:
        super().__init__()
        if bidirectional and hidden_size % 2:
            raise ValueError(f"a bidirectional RNNEncoder needs an even hidden_size, got {hidden_size}")
        self.num_directions = 2 if bidirectional else 1
        self.reverse = reverse
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

    def forward(self, src: Tensor, src_mask: Tensor) -> dict[str, Tensor]:
        x = self.dropout(self.embed(src))  # (B, S, E)
        if self.reverse:
            x = reverse_words(x, src_mask)
        checkpointing = self.gradient_checkpointing and self.training
        out, final_h, final_c = self.kernels.ops(x).encoder_lstm(self.rnn, x, src_mask, checkpointing)
        if self.reverse:
            out = reverse_words(out, src_mask)
        return {"enc_out": self.dropout(out), "src_mask": src_mask, "final_h": final_h, "final_c": final_c}


class RNNDecoder(UsesKernels, nn.Module):
    """LSTM decoder; its wiring follows the papers:

    - ``attention: null`` (``input_feeding: none``): the source reaches the decoder only through
      its initial state, the encoder's final state (the fixed-vector bottleneck; Sutskever et al.
      2014). With ``input_feeding: context`` the same fixed vector, the encoder's top final state
      ``c``, also enters every step with ``y_{i-1}`` and the output ``tanh(W_c [c; s_i])`` (the
      RNN Encoder-Decoder of Cho et al. 2014, the baseline of Bahdanau et al. 2015): still one
      vector for the whole sentence, but the decoder is not left to carry it alone.
    - ``input_feeding: context`` (Bahdanau et al. 2015, eq. 4-6): the previous state
      ``s_{i-1}`` attends, and the context ``c_i`` enters the recurrence with ``y_{i-1}``.
    - ``input_feeding: attentional`` (Luong et al. 2015, sec. 3.3): the new state ``h_t`` attends;
      the attentional vector ``h~_t = tanh(W_c [c_t; h_t])`` (eq. 5) predicts the word and is fed to
      the next step. ``input_feeding: none`` with attention drops that feed, so teacher-forced
      training runs the LSTM over the whole sequence in one call.

    What predicts the word (``output``):

    - ``tanh`` (every preset): ``tanh(W_c [c_i; s_i])`` where there is a context (Luong et al.
      2015, eq. 5, which Joey NMT and OpenNMT also use for Bahdanau's model), ``s_i`` where there
      is none (the plain decoder).
    - ``maxout``: Bahdanau et al.'s deep output (2015, appendix A.2.2), ``t~_i = U_o s_{i-1} +
      V_o E y_{i-1} + C_o c_i`` (one bias-free matrix on ``[s_{i-1}; E y_{i-1}; c_i]``, 2H
      wide), ``t_i = [max(t~_{i,2j-1}, t~_{i,2j})]_{j=1..H}`` (H wide where the paper's ``l`` is
      half its state) and ``p(y_i) ~ exp(W_o t_i)``:
      the state before the step, the previous word and the context, as the appendix writes it.
      It needs ``input_feeding: context`` (the context that the previous state attends to).

    Where the decoder starts (``initial_state``):

    - ``final`` (every preset): the encoder's final states, layer by layer (``h`` and ``c``).
    - ``tanh``: Bahdanau et al.'s ``s_0 = tanh(W_s h<-_1)`` (appendix A.2.2), ``h<-_1`` the
      backward encoder's state at the first word (its final state: it read the sentence back to
      front), from the encoder's top layer; one bias-free ``W_s`` gives every decoder layer its
      ``h_0``; the cell starts at zero (the paper's GRU has none). It needs the bidirectional
      LSTM encoder.

    Step by step (with a feed, and in ``decode_step``) the LSTM runs on ``self.rnn``'s own
    weights, prepared once per sequence by the kernels (``decoder_lstm``: the equations in
    ``nmt.kernels.reference.LSTMSteps``, or one matmul per layer with the CPU kernels), so the
    parameters stay those of ``nn.LSTM``.
    """

    traceable = False  # torch.compile does not trace nn.LSTM; a decoder with a feed compiles its step

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
        output: str = "tanh",
        initial_state: str = "final",
    ) -> None:
        super().__init__()
        if input_feeding not in FEEDS:
            raise ValueError(f"input_feeding must be one of {FEEDS}, got {input_feeding!r}")
        if attention is None and input_feeding == "attentional":
            raise ValueError("input_feeding='attentional' needs an attention; set input_feeding: none or context")
        if output not in OUTPUTS:
            raise ValueError(f"model.decoder.output must be one of {OUTPUTS}, got {output!r}")
        if initial_state not in INITIAL_STATES:
            raise ValueError(f"model.decoder.initial_state must be one of {INITIAL_STATES}, got {initial_state!r}")
        if output == "maxout" and input_feeding != "context":
            raise ValueError(
                f"model.decoder.output=maxout is Bahdanau et al.'s deep output over s_(i-1), y_(i-1) and "
                f"the context c_i: it needs input_feeding: context, got {input_feeding!r}; use output: tanh"
            )
        memory_size = memory_size or hidden_size
        self.memory_size = memory_size
        self.input_feeding = input_feeding
        self.output = output
        self.initial_state = initial_state
        # The encoder's final states (a bridge makes them for an encoder without); ``initial_state: tanh``
        # reads the backward encoder's state instead (``Seq2Seq`` checks the encoder has one).
        self.needs_init_state = num_layers if initial_state == "final" else 0
        self.init_proj = nn.Linear(memory_size // 2, num_layers * hidden_size, bias=False) if initial_state == "tanh" else None  # W_s
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
        self.rnn_dropout = self.rnn.dropout  # between layers, as nn.LSTM applies it (the compiled step reads it here)
        self.attention = attention(query_size=hidden_size, key_size=memory_size) if attention else None
        self.fixed_context = attention is None and input_feeding == "context"  # Cho et al. 2014
        with_context = attention is not None or self.fixed_context
        self.att_out = (nn.Linear(memory_size + hidden_size, hidden_size, bias=False)
                        if with_context and output == "tanh" else None)
        # U_o, V_o and C_o side by side, on [s_(i-1); E y_(i-1); c_i]
        self.maxout = nn.Linear(hidden_size + emb_size + memory_size, 2 * hidden_size, bias=False) if output == "maxout" else None
        self.out = nn.Linear(hidden_size, vocab_size, bias=False)

    def _lstm(self, memory: dict[str, Any]) -> Any:
        """``self.rnn`` prepared for stepping: the memory's, or made now (a memory encoded in
        training, which calls ``nn.LSTM`` once)."""
        if "lstm" in memory:
            return memory["lstm"]
        return self.kernels.ops(memory["enc_out"]).decoder_lstm(self.rnn, self.embed.embedding_dim)

    def prepare_memory(self, memory: dict[str, Tensor]) -> dict[str, Any]:
        """What every step reuses: the LSTM prepared for stepping (not when teacher-forced
        training calls ``nn.LSTM`` once) and, with attention, the values as the steps read them
        and the projected keys."""
        ops = self.kernels.ops(memory["enc_out"])
        if not self.training or (self.attention is not None and self.input_feeding != "none"):
            memory = {**memory, "lstm": ops.decoder_lstm(self.rnn, self.embed.embedding_dim)}
        if self.attention is None:
            return memory
        values = ops.cast_once(memory["enc_out"])
        return {**memory, "enc_out": values, "keys": self.attention.project_keys(values)}

    # A state of one shape at every step, however many (``init_state``'s ``capacity`` changes nothing).
    fixed_state_steps = 1 << 20

    def init_state(self, memory: dict[str, Tensor], capacity: int | None = None) -> dict[str, Any]:
        # (B, L, H); the cell in at least fp32 at every step, also where the encoder (cuDNN's LSTM
        # under autocast) or a bridge gave it in bf16/fp16: it sums every step's update
        if self.initial_state == "tanh":  # s_0 = tanh(W_s h<-_1): the top layer's backward half of the final states
            final = memory["final_h"]
            x = self.init_proj(final[:, -1, final.size(-1) // 2:])
            h = self.kernels.ops(x).tanh(x).view(final.size(0), self.rnn.num_layers, -1)
            state = {"h": h, "c": torch.zeros_like(h, dtype=cell_dtype(h.dtype))}
        else:
            state = {"h": memory["final_h"], "c": memory["final_c"].to(cell_dtype(memory["final_c"].dtype))}
        if self.fixed_context:  # in the state, which beams and finished sentences select rows of
            state["feed"] = memory["final_h"][:, -1]
        if self.input_feeding == "attentional":
            state["feed"] = memory["final_h"].new_zeros(memory["final_h"].shape[0], self.rnn.hidden_size)
        return state

    def _attend(self, query: Tensor, memory: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return self.attention(query, memory["keys"], memory["enc_out"], memory["src_mask"])

    def _output(self, h: Tensor, context: Tensor | None, prev: Tensor | None = None, emb: Tensor | None = None) -> Tensor:
        """What ``self.out`` reads: from the new state ``h`` and the context (``output: tanh``), or
        from the previous state ``prev``, the previous word's embedding ``emb`` and the context
        (``output: maxout``); (B, H) or (B, T, H) alike."""
        if self.maxout is not None:
            t = self.maxout(torch.cat([prev.to(emb.dtype), emb, context.to(emb.dtype)], dim=-1))  # t~ (., 2H)
            return self.dropout(t.unflatten(-1, (-1, 2)).amax(-1))  # pairs of adjacent units
        if context is None:
            return self.dropout(h)
        x = self.att_out(torch.cat([context, h], dim=-1))
        return self.dropout(self.kernels.ops(x).tanh(x))

    def _step(self, y: Any, lstm: Any, memory: dict[str, Any], state: dict[str, Any]) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """One step on the previous word ``y`` (one of ``lstm.inputs``) -> top state (B, H),
        context (B, Hk) | None, attention (B, S) | None; ``state`` (lists ``h``/``c`` of (B, H)
        per layer, and ``feed``) is updated in place."""
        context = attn = None
        if self.fixed_context:
            context = state["feed"]
        elif self.input_feeding == "context":
            context, attn = self._attend(state["h"][-1], memory)
            state["feed"] = context
        lstm.step(y, state.get("feed"), state["h"], state["c"])
        h_top = state["h"][-1]
        if self.attention is not None and self.input_feeding != "context":
            context, attn = self._attend(h_top, memory)
        if self.input_feeding == "attentional":
            state["feed"] = self._output(h_top, context)
        return h_top, context, attn

    def decode_step(
        self, prev: Tensor, memory: dict[str, Tensor], state: dict[str, Any], need_attn: bool = False
    ) -> tuple[Tensor, dict[str, Any], Tensor | None]:
        lstm = self._lstm(memory)
        emb = self.dropout(self.embed(prev))  # (B, E)
        (y,) = lstm.inputs(emb.unsqueeze(1))  # from (B, 1, E)
        step_state = {"h": list(state["h"].unbind(1)), "c": list(state["c"].unbind(1)), "feed": state.get("feed")}
        h_prev = step_state["h"][-1]
        h_top, context, attn = self._step(y, lstm, memory, step_state)
        output = step_state["feed"] if self.input_feeding == "attentional" else self._output(h_top, context, h_prev, emb)
        new_state = {"h": torch.stack(step_state["h"], 1), "c": torch.stack(step_state["c"], 1)}
        if self.input_feeding == "attentional" or self.fixed_context:
            new_state["feed"] = step_state["feed"]
        return self.out(output), new_state, attn

    def _run(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced outputs (B, T, H) and attention (B, T, S) or None."""
        emb = self.dropout(self.embed(tgt_in))  # (B, T, E)
        state = self.init_state(memory)
        if self.input_feeding == "none" or self.fixed_context:  # no recurrence through attention: one LSTM call
            hc = tuple(state[k].transpose(0, 1).to(emb.dtype).contiguous() for k in ("h", "c"))
            if self.fixed_context:  # the same vector at every step: (B, T, H)
                context = state["feed"].unsqueeze(1).expand(-1, emb.size(1), -1).to(emb.dtype)
                h = self.kernels.ops(emb).lstm(self.rnn, torch.cat([emb, context], -1), hc)
                prevs = torch.cat([hc[0][-1].unsqueeze(1).to(h.dtype), h[:, :-1]], 1) if self.maxout is not None else None
                return self._output(h, context, prevs, emb), None
            h = self.kernels.ops(emb).lstm(self.rnn, emb, hc)  # (B, T, H)
            if self.attention is None:
                return self._output(h, None), None
            context, attn = self._attend(h, memory)  # (B, T, Hk), (B, T, S)
            return self._output(h, context), attn
        lstm = self._lstm(memory)
        state = {"h": list(state["h"].unbind(1)), "c": list(state["c"].unbind(1)), "feed": state.get("feed")}
        compiled = self.__dict__.get("_compiled_step")
        if compiled is not None and self.training and torch.is_grad_enabled():
            return self._run_compiled(compiled, emb, memory, state)
        tops, contexts, attns, prevs = [], [], [], []
        for y in lstm.inputs(emb):
            prevs.append(state["h"][-1])
            h_top, context, attn = self._step(y, lstm, memory, state)
            # Luong: the output is the feed, computed in the step; Bahdanau: it does not feed
            # back, so the output layer runs once over all steps below.
            tops.append(state["feed"] if self.input_feeding == "attentional" else h_top)
            contexts.append(context)
            attns.append(attn)
        return self._outputs(tops, contexts, attns, prevs, emb)

    def _outputs(self, tops: list[Tensor], contexts: list[Tensor], attns: list[Tensor], prevs: list[Tensor],
                 emb: Tensor) -> tuple[Tensor, Tensor]:
        """The teacher-forced loop's steps stacked: outputs (B, T, H) (Luong's feeds are its outputs
        already; Bahdanau's go through the output layer here, once for all steps, from the new
        states ``tops`` or the previous ones ``prevs`` and the embeddings ``emb``) and attention (B, T, S)."""
        attn = torch.stack(attns, 1)
        if self.input_feeding == "attentional":
            return torch.stack(tops, 1), attn
        prev = torch.stack(prevs, 1) if self.maxout is not None else None
        return self._output(torch.stack(tops, 1), torch.stack(contexts, 1), prev, emb), attn

    def compile_step(self, dynamic: bool, mode: str | None, backend: str = "inductor") -> bool:
        """``torch.compile`` the teacher-forced step of a decoder whose recurrence reads its
        attention (``Seq2Seq.compile_features``): the step's graph depends on the batch and source
        shapes only, not on the target length. False (nothing compiled) for a decoder that runs
        ``nn.LSTM`` over the whole sequence, whose pass compiles whole."""
        if self.attention is None or self.input_feeding == "none":
            return False
        self._compiled_step = torch.compile(_feed_step, dynamic=dynamic, mode=mode, backend=backend)
        return True

    def _run_compiled(self, compiled: Callable[..., Any], emb: Tensor, memory: dict[str, Any],
                      state: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """``_run``'s loop over the target positions of ``emb`` (B, T, E), a compiled step each (the
        LSTM as the reference equations read, on ``self.rnn``'s weights)."""
        h, c = (tuple(t.contiguous() for t in state[k]) for k in ("h", "c"))  # every step's states alike
        feed, weights = state["feed"], lstm_weights(self.rnn)
        if feed is not None:  # Luong's first feed (zeros) as every later one (dtype, gradient): one graph for all steps
            device = feed.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else feed.dtype
            feed = feed.detach().to(dtype).requires_grad_()
        tops, contexts, attns, prevs = [], [], [], []
        for y in emb.unbind(1):
            prevs.append(h[-1])
            top, context, attn, h, c, feed = compiled(self, weights, y, h, c, feed, memory["keys"], memory["enc_out"],
                                                      memory["src_mask"])
            if self.input_feeding == "context":  # Bahdanau's step computes its feed (the context) first
                feed = None
            tops.append(top)
            contexts.append(context)
            attns.append(attn)
        return self._outputs(tops, contexts, attns, prevs, emb)

    def features(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> Tensor:
        """Teacher-forced outputs (B, T, H), the input of ``self.out``."""
        return self._run(tgt_in, memory)[0]

    def forward(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> Tensor:
        return self.out(self.features(tgt_in, memory))  # (B, T, V)

    def cross_attention(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> Tensor | None:
        attn = self._run(tgt_in, memory)[1]
        return None if attn is None else attn[:, None, None]  # (B, 1, 1, T, S)


def _feed_step(decoder: RNNDecoder, weights: tuple[tuple[Tensor, ...], ...], y: Tensor, h: tuple[Tensor, ...],
               c: tuple[Tensor, ...], feed: Tensor | None, keys: Tensor, values: Tensor,
               src_mask: Tensor) -> tuple[Any, ...]:
    """``RNNDecoder._step`` on tensors (what ``torch.compile`` traces once per shape): the LSTM's
    per-layer weights, the previous word's embedding y (B, E), per-layer states (B, H), the feed
    and the attention memory -> the step's output (the feed for Luong, the top state for
    Bahdanau), context, attention, new states and feed."""
    memory = {"keys": keys, "enc_out": values, "src_mask": src_mask}
    lstm = LSTMSteps.of_weights(weights, decoder.rnn_dropout, decoder.training)
    state = {"h": list(h), "c": list(c), "feed": feed}
    h_top, context, attn = decoder._step(y, lstm, memory, state)
    top = state["feed"] if decoder.input_feeding == "attentional" else h_top
    return top, context, attn, tuple(state["h"]), tuple(state["c"]), state["feed"]

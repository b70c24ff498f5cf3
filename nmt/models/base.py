"""The one model interface every encoder/decoder pair is used through.

A ``Seq2Seq`` holds an encoder and a decoder (chosen separately in ``nmt/conf/model/encoder`` and
``nmt/conf/model/decoder``) and, when the decoder needs an initial state the encoder does not give
(an LSTM decoder after a Transformer encoder), a bridge. Nothing outside this file needs to know
which encoder or decoder it holds:

- ``forward(src, src_mask, tgt_in) -> logits (B, T, V)``: teacher forcing;
  ``features(...) -> (B, T, H)`` is the same before the output layer ``decoder.out``.
- ``encode(src, src_mask) -> memory``; ``init_state(memory) -> state`` (``capacity=n``: a state
  of one shape for n steps, updated in place; ``fixed_state_steps`` says how many it can hold);
  ``decode_step(prev (B,), memory, state) -> (logits (B, V), state, attn (B, S) | None)``;
  the logits are the caller's: decoding normalises them in place.

``memory`` and ``state`` are dicts of batch-first tensors (or None, or objects that are not
dicts, lists or tuples, which ``select`` leaves as they are: an RNN decoder's step weights), so
decoding reorders or repeats them with ``select`` alone. ``decode_step`` accepts a memory with
1/g of ``prev``'s rows, rows i*g .. i*g + g - 1 reading memory row i: beam search keeps one
copy of a sentence's memory for its g beams, and a decoder's attention scores their queries
together.

Encoders return ``{"enc_out": (B, S, H), "src_mask": (B, S)}`` and, if recurrent, the final
states ``"final_h"``/``"final_c"`` (B, L, H). Decoders expose ``prepare_memory`` (precompute what
depends on the source only, e.g. projected attention keys), ``init_state``, ``decode_step``,
``features``, ``forward`` and the
output layer ``out`` (a bias-free Linear, which the training loss applies to the real target
positions only; a decoder whose output layer gives some ids a constant logit applies it in its
``logits`` and says which in ``fixed_logits``: a Transformer decoder with ``start_from_eos``), and
say through ``needs_init_state`` whether they start from a source summary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from nmt.kernels import INT8_NEEDS_CPU_KERNELS, Kernels, UsesKernels
from nmt.kernels import int8

Tree = Any  # nested dict / list / tuple of tensors (or None)


def select(tree: Tree, index: Tensor) -> Tree:
    """Index the batch (first) dimension of every tensor in a nested structure."""
    if isinstance(tree, Tensor):
        return tree.index_select(0, index)
    if isinstance(tree, dict):
        return {k: select(v, index) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(select(v, index) for v in tree)
    return tree


# A preset's sizes that only reach its encoder and decoder configs by interpolation (``${..emb_size}``;
# ``vocab_multiple`` pads their vocabularies) and stay in the run's config as its record.
SHARED_SIZES = ("emb_size", "dropout", "vocab_multiple")


def seq2seq_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved model config (``conf/model/<preset>``, or a checkpoint's) as ``Seq2Seq`` is built
    from it: the ``SHARED_SIZES`` left out."""
    return {key: value for key, value in config.items() if key not in SHARED_SIZES}


class MeanPoolBridge(UsesKernels, nn.Module):
    """Initial LSTM decoder state from an encoder without final states:
    ``h_0 = tanh(W mean_j(h_j))`` for every layer, ``c_0 = 0`` (the mean runs over real tokens).
    Bahdanau et al. 2015 initialise from the backward encoder state in the same ``tanh(W .)`` way."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.num_layers = num_layers
        self.proj = nn.Linear(hidden_size, hidden_size * num_layers)

    def forward(self, memory: dict[str, Tensor]) -> dict[str, Tensor]:
        mask = memory["src_mask"].unsqueeze(-1).to(memory["enc_out"].dtype)  # (B, S, 1)
        mean = (memory["enc_out"] * mask).sum(1) / mask.sum(1).clamp(min=1)  # (B, H)
        x = self.proj(mean)
        h = self.kernels.ops(x).tanh(x).view(mean.size(0), self.num_layers, -1)  # (B, L, H)
        # the cell state in at least fp32, also under autocast
        return {**memory, "final_h": h, "final_c": torch.zeros_like(h, dtype=torch.promote_types(h.dtype, torch.float32))}


class Seq2Seq(nn.Module):
    """Encoder + decoder (+ bridge), with optional embedding tying.

    Args:
        encoder, decoder: built from ``nmt/conf/model/encoder`` and ``nmt/conf/model/decoder``.
        tie_embeddings: share the decoder's input embedding with its output projection
            (Press & Wolf 2017).
        share_src_tgt_embeddings: also share the encoder's embedding (needs a joint vocabulary).
        src_vocab_size, tgt_vocab_size: the tokenizers' sizes; the embedding and output rows
            may be more (``vocab_multiple``: padded for tensor cores). Ids from
            ``tgt_vocab_size`` up are never predicted: the loss and decoding drop those logits.
        hidden_size: the encoder's and decoder's size, that of the bridge where there is one.
        A preset's other shared sizes (``SHARED_SIZES``) reach the encoder and decoder configs by
        interpolation and stay in the run's config; they are no arguments here (``seq2seq_config``).
    """

    def __init__(
        self,
        encoder: nn.Module,
        decoder: nn.Module,
        src_vocab_size: int,
        tgt_vocab_size: int,
        hidden_size: int,
        tie_embeddings: bool = False,
        share_src_tgt_embeddings: bool = False,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.src_vocab_size = src_vocab_size
        self.tgt_vocab_size = tgt_vocab_size
        self.bridge = None
        enc_layers = getattr(encoder, "final_state_layers", 0)
        dec_layers = getattr(decoder, "needs_init_state", 0)
        if dec_layers and enc_layers != dec_layers:
            self.bridge = MeanPoolBridge(hidden_size, dec_layers)
        if getattr(decoder, "initial_state", None) == "tanh" and (
            getattr(encoder, "num_directions", 1) != 2 or getattr(encoder, "reverse", False)
        ):
            raise ValueError(
                "model.decoder.initial_state=tanh starts the decoder from tanh(W_s h<-_1), the backward encoder's "
                "state at the first word (Bahdanau et al. 2015): it needs the bidirectional LSTM encoder "
                "(model/encoder=lstm with bidirectional: true and reverse: false); use initial_state: final"
            )
        if tie_embeddings:
            if decoder.embed.weight.shape != decoder.out.weight.shape:
                raise ValueError(
                    f"tie_embeddings needs the decoder output size to equal emb_size: "
                    f"embedding {tuple(decoder.embed.weight.shape)} vs output "
                    f"{tuple(decoder.out.weight.shape)}"
                )
            decoder.out.weight = decoder.embed.weight
        if share_src_tgt_embeddings:
            if src_vocab_size != tgt_vocab_size or encoder.embed.weight.shape != decoder.embed.weight.shape:
                raise ValueError(
                    "share_src_tgt_embeddings needs a joint vocabulary (data.tokenizer.joint=true) "
                    "and equal encoder/decoder embedding sizes"
                )
            encoder.embed.weight = decoder.embed.weight
        # The one choice of implementation: every module with one computes through this object,
        # and so do the training loss and decoding's log-probabilities (``nmt.kernels``).
        self.kernels = Kernels()
        for module in self.modules():
            if isinstance(module, UsesKernels):
                module.kernels = self.kernels
        self.set_gradient_checkpointing(gradient_checkpointing)

    def set_kernels(self, mode: str) -> "Seq2Seq":
        """Compute with the CPU kernels (``nmt.kernels``) or plain PyTorch: ``auto``,
        ``reference`` or ``cpu`` (the config key ``kernels``), for the whole model at once."""
        self.kernels.mode = mode
        return self

    def quantize_int8(self) -> "Seq2Seq":
        """Int8 matmuls for CPU decoding, in place (``nmt.kernels.int8``): every ``nn.Linear``
        becomes an ``Int8Linear`` and the kernels switch to int8 (the LSTMs' own matmuls);
        returns the model, in eval mode."""
        if self.kernels.mode == "reference":
            raise ValueError(INT8_NEEDS_CPU_KERNELS)
        int8.quantize_linears(self)
        self.kernels.use_int8()
        return self

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each layer's activations in the backward pass (non-reentrant)."""
        for module in (self.encoder, self.decoder):
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = enabled

    def encode(self, src: Tensor, src_mask: Tensor) -> dict[str, Tensor]:
        memory = self.encoder(src, src_mask)
        if self.bridge is not None:
            memory = self.bridge(memory)
        return self.decoder.prepare_memory(memory)

    def init_state(self, memory: dict[str, Tensor], capacity: int | None = None) -> dict[str, Any]:
        """The decoder's first state; with ``capacity``, one whose tensors keep their shapes for that
        many steps (a Transformer's key/value cache preallocated and written in place; an RNN's
        state always is): ``nmt.decoding.fixed_beam`` searches on it."""
        if capacity is None:
            return self.decoder.init_state(memory)
        return self.decoder.init_state(memory, capacity=capacity)

    def narrow_state(self, state: dict[str, Any], steps: int) -> dict[str, Any] | None:
        """A preallocated state (``init_state(capacity=...)``) as views of its first ``steps``
        positions, which a step reads and writes in place (a Transformer's key/value cache: its
        attention reads no further); None for a state without positions (an RNN's)."""
        narrow = getattr(self.decoder, "narrow_state", None)
        return None if narrow is None else narrow(state, steps)

    @property
    def max_source_tokens(self) -> int | None:
        """The most source tokens the encoder has positions for (None: any number)."""
        return getattr(self.encoder, "max_positions", None)

    @property
    def fixed_state_steps(self) -> int:
        """The most steps ``init_state(capacity=...)`` can hold (0: the decoder has no such state)."""
        return int(getattr(self.decoder, "fixed_state_steps", 0))

    def decode_step(
        self, prev: Tensor, memory: dict[str, Tensor], state: dict[str, Any], need_attn: bool = False
    ) -> tuple[Tensor, dict[str, Any], Tensor | None]:
        """One decoder step: prev (B,) -> logits (B, V), new state, attention (B, S) or None."""
        return self.decoder.decode_step(prev, memory, state, need_attn=need_attn)

    def forward(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced logits (B, T, V)."""
        logits = getattr(self.decoder, "logits", self.decoder.out)  # a decoder that fixes some logits says so
        return logits(self.features(src, src_mask, tgt_in))

    def features(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced decoder states (B, T, H) before the output layer ``decoder.out``: the
        loss applies that layer to the real target positions only. In training, the compiled pass
        where ``compile_features`` made one."""
        compiled = self.__dict__.get("_compiled_features")
        if compiled is not None and self.training and torch.is_grad_enabled():
            return compiled(self, src, src_mask, tgt_in)
        return teacher_forced(self, src, src_mask, tgt_in)

    def features_with_attention(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """``features`` (B, T, H) and, from the same pass, the cross-attention weights (B, heads, T, S)
        of decoder ``layer`` (guided alignment, ``nmt.training.guided_alignment``): that layer alone
        computes its weights eagerly. A ValueError for a decoder without such attention (an RNN's)."""
        if not hasattr(self.decoder, "features_with_attention"):
            raise ValueError(f"{type(self.decoder).__name__} has no multi-head cross-attention to read per layer")
        compiled = self.__dict__.get("_compiled_features")
        if compiled is not None and self.training and torch.is_grad_enabled():
            return compiled(self, src, src_mask, tgt_in, layer)
        return teacher_forced(self, src, src_mask, tgt_in, layer)

    def compile_features(self, dynamic: bool = True, mode: str | None = None, backend: str = "inductor") -> None:
        """``torch.compile`` the teacher-forced training pass (what the training loss runs);
        validation and decoding stay eager. ``dynamic=False``: one graph per batch shape (bounded
        by ``data.shapes=buckets``); ``mode``: torch.compile's (``reduce-overhead``: CUDA graphs);
        ``backend``: torch.compile's (the tests trace with ``aot_eager``, which generates no code).
        A decoder with ``compile_step`` (an RNN whose recurrence reads its attention) compiles that
        step instead: one small graph for every target length rather than a loop unrolled per length;
        a model of ``nn.LSTM`` calls alone (``traceable = False`` on both parts: dynamo does not
        trace ``nn.LSTM``) compiles nothing."""
        compile_step = getattr(self.decoder, "compile_step", None)
        if compile_step is not None and compile_step(dynamic, mode, backend):
            return
        if not any(getattr(part, "traceable", True) for part in (self.encoder, self.decoder)):
            return  # nn.LSTM calls alone (cuDNN's on a GPU): compiling would only cut the pass around them
        self._compiled_features = torch.compile(teacher_forced, dynamic=dynamic, mode=mode, backend=backend)

    @property
    def compiled(self) -> bool:
        """Whether ``compile_features`` compiled the training pass (or the decoder's step)."""
        return "_compiled_features" in self.__dict__ or "_compiled_step" in self.decoder.__dict__

    def drop_compiled(self) -> None:
        """Train eager again: what ``compile_features`` compiled is dropped."""
        self.__dict__.pop("_compiled_features", None)
        self.decoder.__dict__.pop("_compiled_step", None)

    def alignment_attention(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, layer: int = -1) -> Tensor | None:
        """(B, T, S) attention of each target position over the source, the one word alignments
        are read from (``nmt.inference.alignments``): an RNN's attention; a Transformer's cross-attention in
        ``layer`` of its decoder, averaged over heads. The last layer by default: it aligns best
        in our presets (docs/alignments.md; Garg et al. 2019 found the penultimate of a 6-layer
        decoder best, ``layer=-2``). The heat maps show the same weights. None without attention."""
        weights = self.cross_attention(src, src_mask, tgt_in)
        if weights is None:
            return None
        return weights[:, layer].mean(1)

    def cross_attention(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor | None:
        """Attention of every target position over the source, for plots:
        (B, layers, heads, T, S) for a Transformer, (B, 1, 1, T, S) for an RNN; None without
        attention."""
        memory = self.encode(src, src_mask)
        return self.decoder.cross_attention(tgt_in, memory)


def teacher_forced(model: Seq2Seq, src: Tensor, src_mask: Tensor, tgt_in: Tensor,
                   attention_layer: int | None = None) -> Any:
    """The teacher-forced pass (B, T, H) of ``model``: encode, then run the decoder over ``tgt_in``
    (a function of the model, so that a compiled copy serves any copy of the model); with
    ``attention_layer``, also that decoder layer's cross-attention weights (B, heads, T, S)."""
    memory = model.encode(src, src_mask)
    if attention_layer is None:
        return model.decoder.features(tgt_in, memory)
    return model.decoder.features_with_attention(tgt_in, memory, attention_layer)

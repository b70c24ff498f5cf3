"""Model FLOPs of a training step, counted analytically per architecture on real tokens: the
forward matmuls (a multiply-add is 2 FLOPs), times 3 for forward + backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nmt.models.rnn import RNNDecoder, RNNEncoder
from nmt.models.transformer import TransformerDecoder, TransformerEncoder
from nmt.specials import PAD


@dataclass
class Lengths:
    """Real-token counts of some batches: sums over sentences of S, T, S^2, T^2 and S*T."""

    sentences: int = 0
    src: int = 0
    tgt: int = 0
    src_sq: int = 0
    tgt_sq: int = 0
    cross: int = 0

    def add(self, batch: dict[str, Any]) -> None:
        s, t = batch["src_mask"].sum(1).double(), (batch["tgt_out"] != PAD).sum(1).double()
        self.sentences += len(s)
        self.src, self.tgt = self.src + int(s.sum()), self.tgt + int(t.sum())
        self.src_sq, self.tgt_sq = self.src_sq + int((s * s).sum()), self.tgt_sq + int((t * t).sum())
        self.cross += int((s * t).sum())


def lstm_encoder_flops(enc: RNNEncoder, n: Lengths) -> float:
    """Per source token and direction, layer l: 2 * 4h * (I_l + h)."""
    rnn = enc.rnn
    dirs, h = 1 + rnn.bidirectional, rnn.hidden_size
    return n.src * sum(dirs * 2 * 4 * h * ((rnn.input_size if l == 0 else dirs * h) + h) for l in range(rnn.num_layers))


def lstm_decoder_flops(dec: RNNDecoder, n: Lengths) -> float:
    """Per target token: the LSTM layers 2 * 4H * (I_l + H), the output projection 2 * H * V,
    ``tanh(W_c [c; h])`` 2 * (Hk + H) * H or the maxout deep output 2 * (H + E + Hk) * 2H and,
    with attention, the query projection, and per
    (target, source) pair the score and the weighted sum; keys are projected once per source token."""
    rnn, H = dec.rnn, dec.rnn.hidden_size
    per_token = sum(2 * 4 * H * ((rnn.input_size if l == 0 else H) + H) for l in range(rnn.num_layers))
    flops = n.tgt * (per_token + 2 * H * dec.out.out_features)
    output = dec.att_out if dec.maxout is None else dec.maxout  # tanh(W_c [c; h]), or the deep output (2H wide)
    if output is not None:
        flops += n.tgt * 2 * output.in_features * output.out_features
    if dec.attention is not None:
        key_size = dec.memory_size
        key_proj, query_proj = getattr(dec.attention, "key_proj", None), getattr(dec.attention, "query_proj", None)
        if key_proj is not None:
            flops += n.src * 2 * key_proj.in_features * key_proj.out_features
        if query_proj is not None:
            flops += n.tgt * 2 * query_proj.in_features * query_proj.out_features
        score_size = key_proj.out_features if key_proj is not None else key_size
        flops += n.cross * 2 * (score_size + key_size)
    return flops


def transformer_encoder_flops(enc: TransformerEncoder, n: Lengths) -> float:
    """Per layer and source token 2 * (4H^2 + 2 H ff), plus self-attention 2 * 2 * S * H."""
    layer = enc.layers[0]
    H, ff = layer.self_attn.q_proj.in_features, layer.ff[0].out_features
    return len(enc.layers) * (n.src * 2 * (4 * H * H + 2 * H * ff) + n.src_sq * 2 * 2 * H)


def transformer_decoder_flops(dec: TransformerDecoder, n: Lengths) -> float:
    """Per layer and target token: self-attention projections 2 * 4H^2, cross-attention query and
    output 2 * 2H^2, feed-forward 2 * 2 H ff, attention over T and S positions 2 * 2 * (T + S) * H;
    cross-attention keys/values 2 * 2 * Hm * H once per source token; output 2 * H * V."""
    layer = dec.layers[0]
    H, ff, mem = layer.self_attn.q_proj.in_features, layer.ff[0].out_features, layer.cross_attn.kv_proj.in_features
    per_layer = n.tgt * 2 * (6 * H * H + 2 * H * ff) + n.src * 2 * 2 * mem * H + (n.tgt_sq + n.cross) * 2 * 2 * H
    return len(dec.layers) * per_layer + n.tgt * 2 * H * dec.out.out_features


FLOPS = {
    RNNEncoder: lstm_encoder_flops,
    RNNDecoder: lstm_decoder_flops,
    TransformerEncoder: transformer_encoder_flops,
    TransformerDecoder: transformer_decoder_flops,
}


def training_flops(model: torch.nn.Module, n: Lengths) -> float:
    """Forward + backward: 3x the forward matmuls."""
    forward = FLOPS[type(model.encoder)](model.encoder, n) + FLOPS[type(model.decoder)](model.decoder, n)
    if model.bridge is not None:
        forward += n.sentences * 2 * model.bridge.proj.weight.numel()
    return 3 * forward

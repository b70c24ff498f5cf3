"""COMET (Rei et al. 2020): a translation's quality estimated from pooled XLM-R sentence embeddings.

The estimator of a COMET regression checkpoint (wmt22-comet-da), in plain PyTorch over
``transformers``' XLM-R encoder:

1. each of source ``s``, hypothesis ``h`` and reference ``r`` is encoded alone by XLM-R
   (Conneau et al. 2020); the hidden states of every layer, embeddings included, are mixed by
   learnt scalar weights (``layer: mix``; softmax or sparsemax of the weights, Martins and
   Astudillo 2016, then a scale ``gamma``), each layer first normalised over the sentence when
   ``layer_norm``;
2. the mix is pooled over the sentence's pieces (``pool: avg``: the mean over real pieces);
3. a feed-forward regressor reads ``[h; r; h*r; |h-r|; h*s; |h-s|]`` and gives the segment score.

The corpus score is the mean of the segment scores. Reading a checkpoint folder is
``nmt.evaluation.comet_files``; this module computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

BOS, PAD, EOS, UNK = 0, 1, 2, 3  # XLM-R's ids (fairseq's dictionary): SentencePiece id i is XLM-R id i + 1
ACTIVATIONS = {"Tanh": nn.Tanh, "Sigmoid": nn.Sigmoid}  # the names a checkpoint's feed-forward may give
POOLS = ("avg", "max", "cls", "default")


class XLMRPieces:
    """XLM-R's tokenizer: SentencePiece pieces with fairseq's ids (``<s>`` 0, ``<pad>`` 1,
    ``</s>`` 2, ``<unk>`` 3, SentencePiece id ``i`` as ``i + 1``), as ``XLMRobertaTokenizer``."""

    def __init__(self, model_proto: bytes, max_length: int) -> None:
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.max_length = max_length  # pieces with <s> and </s>

    def encode(self, text: str) -> list[int]:
        ids = [UNK if i == 0 else i + 1 for i in self.sp.encode(text)]  # SentencePiece's unk is 0
        return [BOS, *ids[: self.max_length - 2], EOS]


def sparsemax(z: Tensor) -> Tensor:
    """The Euclidean projection of ``z`` (L,) onto the probability simplex (Martins and Astudillo
    2016, Alg. 1): ``max(z - tau, 0)``, ``tau`` the threshold that makes it sum to 1."""
    z_sorted, _ = torch.sort(z, descending=True)
    k = torch.arange(1, len(z) + 1, dtype=z.dtype, device=z.device)
    cumsum = z_sorted.cumsum(0)
    k_z = (1 + k * z_sorted > cumsum).sum()  # the support's size
    tau = (cumsum[k_z - 1] - 1) / k_z
    return torch.clamp(z - tau, min=0)


def masked_layer_norm(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` (B, S, H) normalised by the mean and variance of each sentence's real pieces, all
    features together (``mask`` (B, S) float, 1 = real piece)."""
    m = mask.unsqueeze(-1)  # (B, S, 1)
    count = mask.sum(1) * x.size(-1)  # (B,)
    mean = (x * m).flatten(1).sum(1) / count
    var = (((x * m - mean[:, None, None]) * m) ** 2).flatten(1).sum(1) / count
    return (x - mean[:, None, None]) / torch.sqrt(var + 1e-12)[:, None, None]


@dataclass(frozen=True)
class Head:
    """What a checkpoint's ``hparams.yaml`` says about the computation above the encoder."""

    layer: str | int  # "mix" or one layer (0: the embeddings)
    layer_transformation: str  # softmax | sparsemax
    layer_norm: bool
    pool: str  # avg | max | cls | default
    hidden_sizes: tuple[int, ...]
    activations: str
    final_activation: str | None


class CometEstimator(nn.Module):
    """The COMET regression model: ``forward`` reads pieces of sources, hypotheses and references
    (B, S) and gives each triple's score (B,)."""

    def __init__(self, encoder: nn.Module, head: Head) -> None:
        super().__init__()
        self.encoder = encoder  # transformers.XLMRobertaModel without its pooler
        self.head = head
        size, layers = encoder.config.hidden_size, encoder.config.num_hidden_layers + 1
        self.layer_weights = nn.Parameter(torch.zeros(layers))  # one scalar per layer, embeddings first
        self.gamma = nn.Parameter(torch.ones(1))
        act, sizes = ACTIVATIONS[head.activations], [6 * size, *head.hidden_sizes]
        modules: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:]):
            modules += [nn.Linear(a, b), act(), nn.Dropout(0.0)]  # dropout only trains; kept so the indices are COMET's
        modules.append(nn.Linear(sizes[-1], 1))
        if head.final_activation is not None:
            modules.append(ACTIVATIONS[head.final_activation]())
        self.estimator = nn.Sequential(*modules)

    def embed(self, ids: Tensor) -> Tensor:
        """Sentence embeddings (B, H) of pieces ``ids`` (B, S), padded with ``PAD``."""
        mask = ids != PAD  # (B, S)
        out = self.encoder(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
        layers = out.hidden_states  # (num_layers + 1) x (B, S, H)
        if self.head.pool == "default":
            return out.last_hidden_state[:, 0]
        if self.head.layer == "mix":
            transform = sparsemax if self.head.layer_transformation == "sparsemax" else lambda w: torch.softmax(w, 0)
            weights = transform(self.layer_weights)
            if self.head.layer_norm:
                layers = [masked_layer_norm(x, mask.float()) for x in layers]
            states = self.gamma * sum(w * x for w, x in zip(weights, layers))  # (B, S, H)
        else:
            states = layers[int(self.head.layer)]
        if self.head.pool == "cls":
            return states[:, 0]
        if self.head.pool == "max":
            return states.masked_fill(~mask.unsqueeze(-1), float("-inf")).max(1).values
        return states.masked_fill(~mask.unsqueeze(-1), 0.0).sum(1) / mask.sum(1, keepdim=True)  # avg

    def estimate(self, src: Tensor, hyp: Tensor, ref: Tensor) -> Tensor:
        """Scores (B,) of sentence embeddings (B, H) of sources, hypotheses and references."""
        features = torch.cat([hyp, ref, hyp * ref, (hyp - ref).abs(), hyp * src, (hyp - src).abs()], dim=1)  # (B, 6H)
        return self.estimator(features).squeeze(-1)

    def forward(self, src: Tensor, hyp: Tensor, ref: Tensor) -> Tensor:
        return self.estimate(self.embed(src), self.embed(hyp), self.embed(ref))


def pad(rows: Sequence[list[int]]) -> Tensor:
    """Piece lists -> (B, S) int64, padded with ``PAD``."""
    out = torch.full((len(rows), max(len(r) for r in rows)), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


class Comet:
    """A loaded COMET model (``nmt.evaluation.comet_files.load_comet``): segment scores of
    (source, hypothesis, reference) triples, batched by length, each distinct sentence encoded
    once (the sources and references are shared by every system scored)."""

    def __init__(self, model: CometEstimator, tokenizer: XLMRPieces, name: str, batch_size: int = 16,
                 device: str = "cpu") -> None:
        self.model = model.to(device).eval()
        self.tokenizer, self.name, self.batch_size, self.device = tokenizer, name, batch_size, device
        self._cache: dict[str, Tensor] = {}

    @torch.inference_mode()
    def embeddings(self, texts: Sequence[str]) -> Tensor:
        """Sentence embeddings (N, H) of ``texts``, on the CPU; those seen before are not encoded again."""
        pieces = {t: self.tokenizer.encode(t) for t in texts if t not in self._cache}
        new = sorted(pieces, key=lambda t: len(pieces[t]))
        for start in range(0, len(new), self.batch_size):  # similar lengths together: little padding
            batch = new[start : start + self.batch_size]
            ids = pad([pieces[t] for t in batch]).to(self.device)
            for text, row in zip(batch, self.model.embed(ids).float().cpu()):
                self._cache[text] = row
        return torch.stack([self._cache[t] for t in texts]) if texts else torch.zeros(0)

    @torch.inference_mode()
    def score(self, sources: Sequence[str], hyps: Sequence[str], refs: Sequence[str]) -> np.ndarray:
        """Segment scores (N,) float64 of each (source, hypothesis, reference)."""
        if not len(sources) == len(hyps) == len(refs):
            raise ValueError(f"{len(sources)} sources, {len(hyps)} hypotheses and {len(refs)} references differ in number")
        if not hyps:
            return np.zeros(0)
        src, hyp, ref = (self.embeddings(x) for x in (sources, hyps, refs))
        scores = [self.model.estimate(*(x[i : i + self.batch_size].to(self.device) for x in (src, hyp, ref))).float().cpu()
                  for i in range(0, len(hyps), self.batch_size)]
        return torch.cat(scores).double().numpy()

    def forget(self) -> None:
        """Drop the stored embeddings (another test set next)."""
        self._cache.clear()

    def describe(self) -> dict[str, Any]:
        return {"model": self.name, "batch_size": self.batch_size, "device": self.device}

"""Several trained models decoding as one: at every step the members' distributions over the
target vocabulary are averaged in probability space,

    log p(y_t | y_<t, x) = log( 1/M * sum_m p_m(y_t | y_<t, x) ),

as fairseq, Marian and OpenNMT-py decode ensembles. An ``Ensemble`` is used through the same
interface as a ``Seq2Seq`` (``nmt.models.base``), so every search of ``nmt.decoding`` (greedy,
beam with n-best lists and prefixes, the fixed-shape engines, constrained search) and teacher-forced
scoring decode it unchanged. Each member keeps its own encoder output and decoder state: the memory
and the state are lists with one entry per member, which ``select`` reorders like any other tree.

Members may differ in architecture (a Transformer with an LSTM+Luong) but read the same source
ids and write into the same target vocabulary: ``nmt.checkpoints.loading.load_ensemble`` refuses
files whose tokenizers differ. A step's "logits" are the averaged log-probabilities, which the
searches' ``log_softmax`` leaves as they are (they already sum to one), so an ensemble of a model
with itself decodes as the model alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from nmt.models.base import Seq2Seq


class Ensemble(nn.Module):
    """The members' averaged distribution (module docstring). ``members``: two or more ``Seq2Seq``
    with the same ``src_vocab_size`` and ``tgt_vocab_size``."""

    def __init__(self, members: list[Seq2Seq]) -> None:
        super().__init__()
        if len(members) < 2:
            raise ValueError(f"an ensemble needs at least two models, got {len(members)}")
        for key in ("src_vocab_size", "tgt_vocab_size"):
            sizes = {int(getattr(m, key)) for m in members}
            if len(sizes) > 1:
                raise ValueError(f"ensemble members differ in {key}: {sorted(sizes)}")
        self.members = nn.ModuleList(members)
        self.src_vocab_size = members[0].src_vocab_size
        self.tgt_vocab_size = members[0].tgt_vocab_size

    # --- what the searches read ------------------------------------------------------------------
    @property
    def kernels(self):
        """The first member's kernels: they normalise the averaged log-probabilities (a no-op up to
        rounding) in the searches."""
        return self.members[0].kernels

    @property
    def max_source_tokens(self) -> int | None:
        limits = [m.max_source_tokens for m in self.members if m.max_source_tokens is not None]
        return min(limits) if limits else None

    @property
    def fixed_state_steps(self) -> int:
        return min(m.fixed_state_steps for m in self.members)

    def set_kernels(self, mode: str) -> Ensemble:
        for m in self.members:
            m.set_kernels(mode)
        return self

    def quantize_int8(self) -> Ensemble:
        for m in self.members:
            m.quantize_int8()
        return self.eval()

    # --- the Seq2Seq interface --------------------------------------------------------------------
    def encode(self, src: Tensor, src_mask: Tensor) -> list[dict[str, Tensor]]:
        return [m.encode(src, src_mask) for m in self.members]

    def init_state(self, memory: list[dict[str, Tensor]], capacity: int | None = None) -> list[Any]:
        return [m.init_state(mem, capacity=capacity) for m, mem in zip(self.members, memory, strict=True)]

    def narrow_state(self, state: list[Any], steps: int) -> list[Any] | None:
        """Each member's ``narrow_state`` (a member without positions keeps its state); None if no
        member's state has positions."""
        narrowed = [m.narrow_state(st, steps) for m, st in zip(self.members, state, strict=True)]
        if all(x is None for x in narrowed):
            return None
        return [st if x is None else x for st, x in zip(state, narrowed)]

    def decode_step(self, prev: Tensor, memory: list[dict[str, Tensor]], state: list[Any],
                    need_attn: bool = False) -> tuple[Tensor, list[Any], Tensor | None]:
        """One step of every member: the averaged log-probabilities (B, tgt_vocab_size), the
        members' new states, and the mean of the members' attention (None if none has any)."""
        log_probs, states, attns = [], [], []
        for m, mem, st in zip(self.members, memory, state, strict=True):
            logits, st, attn = m.decode_step(prev, mem, st, need_attn=need_attn)
            log_probs.append(self._normalised(logits))
            states.append(st)
            if attn is not None:
                attns.append(attn.float())
        return self._average(log_probs), states, _mean(attns)

    def forward(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced averaged log-probabilities (B, T, tgt_vocab_size): what scoring reads."""
        return self._average([self._normalised(m(src, src_mask, tgt_in)) for m in self.members])

    def alignment_attention(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, layer: int = -1) -> Tensor | None:
        """(B, T, S): the mean of the members' alignment attention (``Seq2Seq.alignment_attention``)
        over the members that have attention; None if none has."""
        return _mean([w.float() for m in self.members
                      if (w := m.alignment_attention(src, src_mask, tgt_in, layer)) is not None])

    def cross_attention(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor | None:
        """(B, 1, 1, T, S): the members' averaged alignment attention, as one layer of one head
        (the members' layers and heads need not match), for plots."""
        weights = self.alignment_attention(src, src_mask, tgt_in)
        return None if weights is None else weights[:, None, None]

    # --- the average ---------------------------------------------------------------------------
    def _normalised(self, logits: Tensor) -> Tensor:
        """A member's log-probabilities over the real target vocabulary, in fp32."""
        return torch.log_softmax(logits[..., : self.tgt_vocab_size].float(), dim=-1)

    def _average(self, log_probs: list[Tensor]) -> Tensor:
        """log(mean_m exp(log_probs[m])), computed stably."""
        return torch.logsumexp(torch.stack(log_probs), dim=0) - math.log(len(log_probs))


def _mean(tensors: list[Tensor]) -> Tensor | None:
    return torch.stack(tensors).mean(0) if tensors else None

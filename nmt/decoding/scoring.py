"""What every search computes the same way: each sentence's length cap, the log-probabilities a
step normalises its logits to, forced tokens, the best candidates of a beam step, the GNMT length
penalty and its bound, and the hypotheses a search returns (``nmt.decoding.search``,
``nmt.decoding.fixed_beam``, ``nmt.decoding.constrained``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nmt.kernels import Kernels
from nmt.specials import BOS, EOS, PAD


@dataclass
class Hypotheses:
    """Best hypothesis per sentence: token ids without BOS/EOS, its score (sum of log-probs;
    divided by the length penalty for beam search) and, if asked, attention (T_i, S) over the
    padded source. ``nbest`` (beam search with ``nbest > 1``): per sentence, its best hypotheses
    as (tokens, score) pairs, best first."""

    tokens: list[list[int]]
    scores: Tensor
    attn: list[Tensor] | None = None
    nbest: list[list[tuple[list[int], float]]] | None = None


def max_lengths(src_mask: Tensor, max_len_a: float, max_len_b: int, max_len: Tensor | None = None) -> Tensor:
    """Each sentence's cap: ``max_len_a * source length + max_len_b`` tokens, or ``max_len`` (B,)
    where that is smaller."""
    cap = (max_len_a * src_mask.sum(1).float() + max_len_b).long()
    if max_len is not None:
        cap = torch.minimum(cap, max_len.to(cap))
    return cap.clamp(min=1)  # (B,)


def length_cap(source_tokens: int, max_len_a: float, max_len_b: int) -> int:
    """The cap ``max_lengths`` gives a source of ``source_tokens`` tokens (EOS included), computed
    the same way (fp32), for checks made before decoding."""
    return int(max_lengths(torch.ones(1, source_tokens, dtype=torch.bool), max_len_a, max_len_b)[0])


CHUNK = 64  # beam search compares the maxima of chunks of this many log-probs before the log-probs


def log_probs(logits: Tensor, vocab_size: int, kernels: Kernels) -> Tensor:
    """Log-probabilities over the real vocabulary in fp32, (rows, W) with W the vocabulary size
    rounded up to a multiple of ``CHUNK`` (the extra columns -inf), normalised by the model's
    ``kernels`` (with the CPU kernels fp32 logits in place: a beam step's passes over its
    (rows, V) logits cost as much as its output matmul). PAD and BOS are never generated: -inf
    after normalising, so the probabilities are those of a softmax over the whole vocabulary.
    ``logits`` are the caller's to overwrite (decoders return a fresh tensor each step)."""
    rows = logits.shape[:-1]
    width = -(-vocab_size // CHUNK) * CHUNK
    if logits.size(-1) != width or width != vocab_size:  # padded into a buffer, normalised there
        x = logits.new_full((*rows, width), float("-inf"), dtype=torch.float32)
        x[..., :vocab_size] = logits[..., :vocab_size]
    else:
        x = logits.contiguous()
    x = kernels.ops(x).log_softmax(x)
    x[..., PAD] = float("-inf")
    x[..., BOS] = float("-inf")
    return x


def force_tokens(x: Tensor, token: Tensor, zero: bool = False) -> Tensor:
    """Log-probs ``x`` (rows, W) where each row whose ``token`` (rows,) is not PAD may only continue
    with that token, at the model's log-prob (``zero``: at 0, as transformers' forcing gives it)."""
    keep = torch.zeros_like(x[:, :1]) if zero else x.gather(1, token.unsqueeze(1))
    forced = torch.full_like(x, float("-inf")).scatter_(1, token.unsqueeze(1), keep)
    return torch.where((token != PAD).unsqueeze(1), forced, x)


def check_prefix(prefix: Tensor | None, max_len: Tensor) -> None:
    """A prefix must leave room for EOS within the sentence's cap."""
    if prefix is None:
        return
    lengths = (prefix != PAD).sum(1)
    over = (lengths >= max_len).nonzero().flatten().tolist()
    if over:
        i = over[0]
        raise ValueError(f"a target prefix of {int(lengths[i])} tokens for sentence {i} of the batch reaches its length "
                         f"cap of {int(max_len[i])} tokens (decoding.max_len_a * source tokens + max_len_b)")


def top_candidates(x: Tensor, beam_scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` best continuations of each sentence's beams: scores beam_score + log-prob
    (n, k) and their flat indices beam * W + token into (n, K * W), for log-probs ``x``
    (n * K, W); the same as a top-k over all K * W scores, without sorting them: the k best lie
    in the k chunks of ``CHUNK`` log-probs with the best maxima (a chunk holding one of them has
    a maximum at least that good, and at most k - 1 candidates are better)."""
    n, beams = beam_scores.shape
    width = x.size(-1)
    per_beam = width // CHUNK
    if beams * per_beam <= 2 * k:  # too few chunks to be worth it: score everything
        cand = beam_scores.unsqueeze(-1) + x.view(n, beams, width)
        return cand.view(n, -1).topk(k, dim=1)
    chunks = x.view(n, beams * per_beam, CHUNK)
    chunk_best = beam_scores.unsqueeze(-1) + chunks.amax(-1).view(n, beams, per_beam)
    best_chunks = chunk_best.view(n, -1).topk(k, dim=1).indices  # (n, k)
    values = chunks.gather(1, best_chunks.unsqueeze(-1).expand(n, k, CHUNK))  # (n, k, CHUNK)
    values = values + beam_scores.gather(1, best_chunks // per_beam).unsqueeze(-1)
    top, pos = values.view(n, -1).topk(k, dim=1)
    return top, best_chunks.gather(1, pos // CHUNK) * CHUNK + pos % CHUNK


def to_lists(tokens: Tensor) -> list[list[int]]:
    out = []
    for row in tokens.tolist():
        out.append(row[: row.index(EOS)] if EOS in row else [t for t in row if t != PAD])
    return out


def length_penalty(length: Tensor, alpha: float) -> Tensor:
    """GNMT length penalty, Wu et al. 2016 eq. 14: ((5 + |Y|) / 6) ** alpha."""
    return ((5.0 + length.float()) / 6.0) ** alpha


def hf_penalty(length: Tensor, alpha: float) -> Tensor:
    """Hugging Face transformers' length normalisation: |Y| ** alpha, |Y| the generated tokens, the
    EOS and any forced first token counted (the decoder start not)."""
    return length.float() ** alpha


def hf_stops(worst: Tensor, best_running: Tensor, t: int, max_len: Tensor, alpha: float,
             early_stopping: bool | str, finished: Tensor, beams: int) -> Tensor:
    """Which sentences transformers' beam search stops after step ``t`` (0-based): its K-slot list of
    ended hypotheses is full (``worst``, the K-th best normalised score, above -inf) and the best
    live log-prob ``best_running``, divided by the length so far (by the cap's with
    ``early_stopping="never"`` and a positive ``alpha``), is no better than ``worst``; or, with
    ``early_stopping=True``, ``beams`` hypotheses have ended (``finished``). A heuristic, not a
    bound: with ``alpha`` > 0 a longer hypothesis may still have won."""
    if early_stopping == "never" and alpha > 0:
        length = max_len
    else:
        length = torch.full_like(max_len, t + 1)
    stop = worst >= best_running / hf_penalty(length, alpha)
    if early_stopping is True:
        stop |= finished >= beams
    return stop


def best_possible(score: Tensor, t: int | Tensor, max_len: Tensor, alpha: float) -> Tensor:
    """The best normalised score that a live hypothesis with log-prob ``score`` (<= 0) after
    step ``t`` (a number, or a tensor of one) can still end with: its log-prob can only fall, and
    it ends with between t + 2 and ``max_len`` tokens, so score / length_penalty is at most the
    larger of the two ends'."""
    shortest = length_penalty(torch.full_like(max_len, t + 2) if isinstance(t, int) else (t + 2).expand_as(max_len), alpha)
    return torch.maximum(score / shortest, score / length_penalty(max_len, alpha))

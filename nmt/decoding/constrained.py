"""Lexically constrained beam search: every given target phrase appears in the output.

Dynamic beam allocation (Post and Vilar 2018), one sentence at a time over its beams, with any
model of ``nmt.models`` (its ``encode``/``decode_step``, as ``nmt.decoding.search``). Each hypothesis
tracks which constraints it has met and how far it is into the one it is writing. A step's
candidates are the K best continuations of all beams, each beam's best token, and, for each
beam, the next token of the constraint it is inside or the first token of each constraint it
has not met. A candidate that breaks off a constraint midway loses that progress. The K beams are
then shared out over banks by the number of constraint tokens met (0 .. C), the same number
each, a bank's unused places going to the others, best scores first within a bank, so that
hypotheses that have met more constraints are not crowded out by ones that score better
without them. EOS is allowed only once every constraint is met, so every hypothesis that ends
holds them all; the length cap must leave room for them (``check_constraints``). Phrases are
met as whole words: the token after one must start a word. Scores are the
model's log-probs over the GNMT length penalty, as beam search's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from nmt.decoding.scoring import Hypotheses, length_penalty, log_probs, max_lengths
from nmt.models.base import select
from nmt.specials import BOS, EOS

log = logging.getLogger(__name__)
Phrase = tuple[int, ...]


@dataclass(frozen=True)
class Progress:
    """Which constraints a hypothesis has met, and (constraint, tokens written) of the one it is inside."""

    met: frozenset[int] = frozenset()
    inside: tuple[int, int] | None = None
    just_met: bool = False  # the last token ended a constraint: the next must start a word

    def tokens_met(self, constraints: list[Phrase]) -> int:
        return sum(len(constraints[c]) for c in self.met) + (self.inside[1] if self.inside else 0)

    def after(self, token: int, constraints: list[Phrase]) -> Progress:
        if self.inside is not None:
            c, done = self.inside
            if constraints[c][done] == token:
                return self._advanced(c, done + 1, constraints)
        # not continuing the constraint it was inside (if any): start one whose first token this is
        for c, phrase in enumerate(constraints):
            if c not in self.met and phrase[0] == token:
                return Progress(self.met)._advanced(c, 1, constraints)
        return Progress(self.met)

    def _advanced(self, c: int, done: int, constraints: list[Phrase]) -> Progress:
        if done == len(constraints[c]):
            return Progress(self.met | {c}, None, True)
        return Progress(self.met, (c, done))

    def wanted(self, constraints: list[Phrase]) -> set[int]:
        """The tokens that make progress: the next of the constraint it is inside, else the first
        of each constraint not met."""
        if self.inside is not None:
            c, done = self.inside
            return {constraints[c][done]}
        return {phrase[0] for c, phrase in enumerate(constraints) if c not in self.met}


def check_constraints(constraints: list[Phrase], cap: int) -> None:
    """Every constraint a non-empty phrase, and all of them together (with EOS) within ``cap``."""
    if any(len(p) == 0 for p in constraints):
        raise ValueError("an empty constraint")
    total = sum(len(p) for p in constraints)
    if total >= cap:
        raise ValueError(f"the constraints hold {total} target tokens, but the translation is capped at {cap} "
                         "(decoding.max_len_a * source tokens + decoding.max_len_b, EOS included)")


def _allocate(banks: list[int], k: int) -> list[int]:
    """Indices of the ``k`` candidates kept, candidates given best first with their bank: each bank
    gets k // (banks) places (the highest banks the remainder), places a bank cannot fill go to
    the best of the rest."""
    levels = sorted(set(banks))
    size, extra = divmod(k, len(levels))
    quota = {level: size + (1 if i >= len(levels) - extra else 0) for i, level in enumerate(levels)}
    kept, rest = [], []
    for i, level in enumerate(banks):
        if quota[level] > 0:
            quota[level] -= 1
            kept.append(i)
        else:
            rest.append(i)
    return sorted(kept + rest[: k - len(kept)])


@torch.no_grad()
def constrained_beam_search(model, src: Tensor, src_mask: Tensor, constraints: list[list[Phrase]], beam_size: int = 5,
                            alpha: float = 0.6, max_len_a: float = 1.5, max_len_b: int = 10,
                            need_attn: bool = False, nbest: int = 1, continuation: Tensor | None = None) -> Hypotheses:
    """Beam search in which sentence i's output holds every phrase of ``constraints[i]``.
    ``continuation`` (vocabulary,) bools: the pieces that continue a word (no "▁"); a constraint
    is then met only as whole words: the token after it must start a word (or be EOS)."""
    caps = max_lengths(src_mask, max_len_a, max_len_b)
    results, scores = [], []
    for i in range(src.size(0)):
        cons = [tuple(int(t) for t in p) for p in constraints[i]]
        check_constraints(cons, int(caps[i]))
        length = int(src_mask[i].sum())
        tokens, score = _one(model, src[i : i + 1, :length], src_mask[i : i + 1, :length], cons, beam_size, alpha,
                             int(caps[i]), nbest, continuation)
        results.append(tokens)
        scores.append(score)
    best = [r[0][0] for r in results]
    nbest_out = [[(t, s) for t, s in r] for r in results] if nbest > 1 else None
    return Hypotheses(best, torch.tensor([r[0][1] for r in results]), None, nbest_out)


def _one(model, src: Tensor, src_mask: Tensor, constraints: list[Phrase], k: int, alpha: float, cap: int,
         nbest: int, continuation: Tensor | None) -> tuple[list[tuple[list[int], float]], float]:
    """The ``nbest`` best (tokens, score) of one sentence, best first."""
    device = src.device
    memory = model.encode(src, src_mask)
    state = select(model.init_state(memory), torch.zeros(1, dtype=torch.long, device=device))
    prev = torch.tensor([BOS], device=device)
    beams: list[tuple[list[int], float, Progress]] = [([], 0.0, Progress())]
    ended: list[tuple[float, list[int]]] = []
    for t in range(cap):
        logits, state, _ = model.decode_step(prev, memory, state)
        x = log_probs(logits, model.tgt_vocab_size, model.kernels)  # (beams, W)
        width = x.size(1)
        total = torch.tensor([b[1] for b in beams], device=device).unsqueeze(1) + x
        open_ = torch.tensor([len(b[2].met) < len(constraints) for b in beams], device=device)
        total[:, EOS] = total[:, EOS].masked_fill(open_, float("-inf"))  # EOS only once every constraint is met
        if continuation is not None:  # a constraint just met ends its word
            for b, (_, _, progress) in enumerate(beams):
                if progress.just_met:
                    total[b, : continuation.numel()] = total[b, : continuation.numel()].masked_fill(continuation, float("-inf"))
        if t == cap - 1:  # at the cap only EOS may follow
            total[:, :EOS] = float("-inf")
            total[:, EOS + 1 :] = float("-inf")
        picks = set(total.view(-1).topk(min(k, total.numel())).indices.tolist())
        picks |= {b * width + int(total[b].argmax()) for b in range(len(beams))}
        for b, (_, _, progress) in enumerate(beams):
            picks |= {b * width + w for w in progress.wanted(constraints)}
        candidates = []
        for flat in picks:
            b, w = divmod(flat, width)
            score = float(total[b, w])
            if score == float("-inf"):
                continue
            if w == EOS:
                norm = score / float(length_penalty(torch.tensor(t + 1), alpha))
                ended.append((norm, beams[b][0]))
                continue
            candidates.append((score, b, w, beams[b][2].after(w, constraints)))
        if len(ended) >= k or not candidates:
            break
        candidates.sort(key=lambda c: -c[0])
        kept = [candidates[i] for i in _allocate([c[3].tokens_met(constraints) for c in candidates], k)]
        origin = torch.tensor([c[1] for c in kept], device=device)
        state = select(state, origin)
        prev = torch.tensor([c[2] for c in kept], device=device)
        beams = [(beams[b][0] + [w], score, progress) for score, b, w, progress in kept]
    if not ended:  # no hypothesis met every constraint by the cap (check_constraints leaves room, so rare)
        log.warning("constrained search: no hypothesis holds all %d constraints within the cap of %d tokens; "
                    "returning the best one", len(constraints), cap)
        ended = [(max(b[1] for b in beams), max(beams, key=lambda b: b[1])[0])]
    ranked = sorted(ended, key=lambda e: -e[0])[:nbest]
    return [(tokens, score) for score, tokens in ranked], ranked[0][0]

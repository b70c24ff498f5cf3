"""Lexically constrained beam search: every given target phrase appears in the output.

Dynamic beam allocation (Post and Vilar 2018) for a whole batch at once, in the vectorised form of
Hu et al. (2019), with any model of ``nmt.models`` through its ``Seq2Seq`` interface (as
``nmt.decoding.search``; one copy of a sentence's memory serves its K beams). Each hypothesis's
constraint state is a node of its sentence's phrase automaton and how often it has written each
phrase (``nmt.decoding.constraint_automaton``), so overlapping and repeated phrases are found and
nothing is read from the device but once a step, to stop. A step's candidates are the K best
continuations of a sentence's beams, each beam's best token (with ``huggingface``, its best but EOS:
there an EOS outside the K best ends nothing), and each beam's tokens that advance a constraint: the
next of the phrase it is inside, or the first of each phrase it has not met. A candidate that breaks
off a phrase midway loses that progress. The K beams are then shared out
over banks by the number of constraint tokens met, the same number each, a bank's unused places
going to the others, best scores first within a bank (``allocate``), so that hypotheses that have
met more constraints are not crowded out by ones that score better without them. EOS is allowed
only once every constraint is met, so every hypothesis that ends holds them all; the length cap
must leave room for them (``check_constraints``). A sentence stops once K hypotheses have ended,
or once none of its live ones can still beat its n-th best (as beam search; no result changes).
Phrases are met as whole words: the token after one must start a word, unless the word goes on
into a longer phrase (then the shorter one is not met there). Scores are the model's log-probs
over the GNMT length penalty, as beam search's; with ``scoring="huggingface"``, over ``|Y| ** alpha``
with transformers' rules, as ``nmt.decoding.search.beam_search`` applies them (a forced EOS at the
cap scores 0, only an EOS among a step's K best candidates ends a hypothesis, K ended ones are
kept, transformers' stopping rule), so that without constraints it is that beam search. A target
``prefix`` (the language code an imported M2M100, NLLB-200 or mBART-50 model writes first) is forced
as beam search forces it, before any constraint token: a forced token leaves every hypothesis's
constraint state as it was, so it never meets a phrase, and the cap must leave room for it too.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from nmt.decoding.constraint_automaton import ConstraintAutomata, Phrase
from nmt.decoding.scoring import (Hypotheses, best_possible, check_prefix, force_tokens, hf_penalty, hf_stops,
                                  length_penalty, log_probs, max_lengths, to_lists)
from nmt.decoding.settings import SCORINGS
from nmt.models.base import select
from nmt.specials import BOS, EOS, PAD

log = logging.getLogger(__name__)


def check_constraints(constraints: list[Phrase], cap: int, forced: int = 0) -> None:
    """Every constraint a non-empty phrase, and all of them together (with EOS and the ``forced``
    tokens the output starts with, a target-language code) within ``cap``."""
    if any(len(p) == 0 for p in constraints):
        raise ValueError("an empty constraint")
    total = sum(len(p) for p in constraints)
    if total + forced >= cap:
        after = f", {forced} of them the forced target-language code" if forced else ""
        raise ValueError(f"the constraints hold {total} target tokens, but the translation is capped at {cap} "
                         f"(decoding.max_len_a * source tokens + decoding.max_len_b, EOS included{after})")


def allocate(banks: Tensor, valid: Tensor, k: int, levels: int) -> Tensor:
    """Which of each row's candidates are kept, (n, M) bools, for candidates given best first
    with their ``banks`` (n, M) in [0, ``levels``), ``valid`` (n, M) marking the real ones: each
    bank present gets k // (banks present) places (the highest banks one more, for the
    remainder), and the places a bank cannot fill go to the best of the rest."""
    member = (banks.unsqueeze(-1) == torch.arange(levels, device=banks.device)) & valid.unsqueeze(-1)
    member = member.long()  # (n, M, levels); not one_hot, which reads the device
    present = member.amax(1)  # (n, levels)
    count = present.sum(1, keepdim=True).clamp(min=1)
    quota = k // count + (present.cumsum(1) > count - k % count).long()  # (n, levels), for the banks present
    rank = (member.cumsum(1) - 1).gather(2, banks.unsqueeze(-1)).squeeze(-1)  # place within its bank (n, M)
    first = valid & (rank < quota.gather(1, banks))
    rest = valid & ~first
    return first | (rest & (rest.cumsum(1) <= k - first.sum(1, keepdim=True)))


@torch.no_grad()
def constrained_beam_search(model, src: Tensor, src_mask: Tensor, constraints: list[list[Phrase]], beam_size: int = 5,
                            alpha: float = 0.6, max_len_a: float = 1.5, max_len_b: int = 10,
                            need_attn: bool = False, nbest: int = 1, continuation: Tensor | None = None,
                            scoring: str = "gnmt", early_stopping: bool | str = False,
                            prefix: Tensor | None = None) -> Hypotheses:
    """Beam search in which sentence i's output holds every phrase of ``constraints[i]`` (a
    phrase given twice, twice). src, src_mask: (B, S). ``continuation`` (vocabulary,) bools: the
    pieces that continue a word (no "▁"); a constraint is then met only as whole words: the token
    after it must start a word (or be EOS). Attention weights are not returned. ``scoring``
    (``SCORINGS``) and ``early_stopping``: how ended hypotheses rank and when a sentence stops, as
    ``nmt.decoding.search.beam_search``'s. ``prefix`` (B, P), PAD-padded: target tokens every
    output of a sentence starts with (an imported model's target-language code), forced as beam
    search forces them (their log-probs, or 0 with ``huggingface``); they never advance a constraint."""
    if scoring not in SCORINGS:
        raise ValueError(f"decoding.scoring={scoring!r}: choose one of {', '.join(SCORINGS)}")
    hf = scoring == "huggingface"
    batch, k, n_best = src.size(0), beam_size, (beam_size if hf else nbest)  # transformers keeps K ended
    device = src.device
    caps = max_lengths(src_mask, max_len_a, max_len_b)
    phrases = [[tuple(int(t) for t in p) for p in cons] for cons in constraints]
    cap_list = caps.tolist()
    check_prefix(prefix, caps)
    forced = [0] * batch if prefix is None else (prefix != PAD).sum(1).tolist()
    for cons, cap, lead in zip(phrases, cap_list, forced):
        check_constraints(cons, cap, lead)
    automata = ConstraintAutomata(phrases, device)
    steps = max(cap_list)
    memory = model.encode(src, src_mask)  # (B, ...): one copy serves a sentence's K beams
    state = select(model.init_state(memory), torch.arange(batch, device=device).repeat_interleave(k))  # (B*K, ...)
    prev = src.new_full((batch * k,), BOS)
    beam_scores = torch.full((batch, k), float("-inf"), device=device)
    beam_scores[:, 0] = 0.0  # all beams start identical: keep one
    node, count = automata.start((batch, k))  # (B, K), (B, K, C)
    just_met = torch.zeros(batch, k, dtype=torch.bool, device=device)
    before = count  # the counts before the last token, (B, K, C)
    history = src.new_zeros(batch * k, 0)  # (B*K, t)
    best_scores = torch.full((batch, n_best), float("-inf"), device=device)  # ended hypotheses, best first
    best_tokens = src.new_full((batch, n_best, steps + 1), PAD)
    num_ended = torch.zeros(batch, dtype=torch.long, device=device)
    fell_back = torch.zeros(batch, dtype=torch.bool, device=device)
    active = torch.arange(batch, device=device)  # the sentences still searching
    beam_index = torch.arange(k, device=device)
    for t in range(steps):
        n = active.numel()
        logits, state, _ = model.decode_step(prev, memory, state)
        x = log_probs(logits, model.tgt_vocab_size, model.kernels)  # (n*K, W)
        width = x.size(1)
        inside = None  # (n,): the sentences whose step t is a forced prefix token
        if prefix is not None and t < prefix.size(1):
            inside = prefix[active, t] != PAD
            x = force_tokens(x, prefix[active, t].repeat_interleave(k), hf)
        sent = active.unsqueeze(1).expand(n, k)
        x[:, EOS] = x[:, EOS].masked_fill(automata.unmet(sent, count).any(-1).view(-1), float("-inf"))
        wanted, real, deeper = automata.wanted(sent, node, count)  # (n, K, D), (n, K, D), (n, K)
        if continuation is not None:  # a phrase just met ends its word, unless the word goes on into a longer phrase
            forbid = just_met.view(-1, 1) & continuation  # (n*K, V)
            onward = torch.where(real & deeper.unsqueeze(-1), wanted, PAD).view(n * k, -1)
            x[:, : continuation.numel()].masked_fill_(forbid.scatter_(1, onward, False), float("-inf"))
        if t >= min(cap_list) - 1:  # only EOS may follow at the cap
            at_cap = (t >= caps[active] - 1).repeat_interleave(k).unsqueeze(1)
            x = x.masked_fill(at_cap & (torch.arange(width, device=device) != EOS), float("-inf"))
            if hf:  # transformers' forced EOS: log-prob 0 (where the constraints let it end)
                x[:, EOS] = torch.where(at_cap.squeeze(1) & (x[:, EOS] > float("-inf")), 0.0, x[:, EOS])
        total = (beam_scores.unsqueeze(-1) + x.view(n, k, width)).view(n, k * width)
        # candidates, as flat indices beam * W + token (n, M): the K best (huggingface: 2K, transformers'
        # candidates, so the K best that do not end are among them), each beam's best, the tokens that advance
        best_k = total.topk(2 * k if hf else k, dim=1).indices
        if hf:  # each beam's best token but EOS: an EOS outside the K best ends nothing, and a beam that has met
            # every constraint and would rather end must still go on (else it drops out and the search falls back)
            two = total.view(n, k, width).topk(2, dim=-1).indices  # (n, K, 2)
            beam_best = torch.where(two[..., 0] == EOS, two[..., 1], two[..., 0])
        else:
            beam_best = total.view(n, k, width).argmax(-1)
        flat = torch.cat([best_k,
                          beam_best + beam_index * width,
                          torch.where(real, beam_index.unsqueeze(1) * width + wanted, -1).view(n, -1)], 1)
        m = flat.size(1)
        flat = torch.where(flat >= 0, flat, -1 - torch.arange(m, device=device))  # padding: distinct, negative
        ordered, order = flat.sort(1)
        repeat = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, order[:, 1:], ordered[:, 1:] == ordered[:, :-1])
        flat = flat.clamp(min=0)
        score = total.gather(1, flat)
        valid = (score > float("-inf")) & ~repeat
        beam, token = flat // width, flat % width
        ending = valid & (token == EOS)
        going = valid & ~ending
        if hf:  # transformers ends only the EOS among the K best candidates; the others are dropped
            ending &= (flat.unsqueeze(-1) == best_k[:, :k].unsqueeze(1)).any(-1)
        # the candidates that end: into each sentence's n-best (a beam ends at most once a step)
        penalty = (hf_penalty if hf else length_penalty)(torch.tensor(t + 1, device=device), alpha)
        norm = (score / penalty).masked_fill(~ending, float("-inf"))
        by_beam = norm.new_full((n, k), float("-inf")).scatter_reduce(1, beam, norm, "amax")  # (n, K)
        merged, pick = torch.cat([best_scores[active], by_beam], 1).topk(n_best, dim=1)
        ended_tokens = src.new_full((n, k, steps + 1), PAD)
        ended_tokens[:, :, :t] = history.view(n, k, t)
        pool = torch.cat([best_tokens[active], ended_tokens], 1)  # (n, n_best + K, steps + 1)
        best_tokens[active] = pool.gather(1, pick.unsqueeze(-1).expand(n, n_best, steps + 1))
        best_scores[active] = merged
        num_ended[active] += ending.sum(1)
        # the candidates that go on: their constraint state, their banks, then the K kept
        cand_sent = active.unsqueeze(1).expand(n, m)
        by_cand = beam.unsqueeze(-1).expand(n, m, count.size(-1))
        cand_before = count.gather(1, by_cand)
        if continuation is not None:  # a phrase just met that its word goes on from was not met as a word
            undo = just_met.gather(1, beam) & continuation[token.clamp(max=continuation.numel() - 1)]
            cand_before = torch.where(undo.unsqueeze(-1), before.gather(1, by_cand), cand_before)
        cand_node, cand_count, cand_met = automata.advance(cand_sent, node.gather(1, beam), cand_before, token)
        if inside is not None:  # a forced token leaves the constraint state as it was
            held = inside.unsqueeze(1)
            cand_node = torch.where(held, node.gather(1, beam), cand_node)
            cand_count = torch.where(held.unsqueeze(-1), cand_before, cand_count)
            cand_met = cand_met & ~held
        # a sentence searches on until K hypotheses have ended, or until none that goes on can still
        # beat the last of its n best (which changes no result), or none goes on
        best_going = score.masked_fill(~going, float("-inf")).amax(1)
        if hf:
            searching = ~hf_stops(best_scores[active, -1], best_going, t, caps[active], alpha, early_stopping,
                                  num_ended[active], k)
        else:
            searching = (num_ended[active] < k) & (best_scores[active, -1] < best_possible(best_going, t, caps[active],
                                                                                           alpha))
        # a sentence that stops without an ended hypothesis (rare: check_constraints leaves room) keeps its best beam
        fallback = ~searching & (best_scores[active, 0] == float("-inf"))
        raw, top_beam = beam_scores.max(1)
        best_scores[active, 0] = torch.where(fallback, raw, best_scores[active, 0])
        last = history.view(n, k, t).gather(1, top_beam.view(n, 1, 1).expand(n, 1, t)).squeeze(1)
        best_tokens[active, 0, :t] = torch.where(fallback.unsqueeze(1), last, best_tokens[active, 0, :t])
        fell_back[active] |= fallback
        keep = int(searching.sum())  # the one read of a step
        if keep == 0:
            break
        banks = automata.tokens_met(cand_sent, cand_node, cand_count)
        _, by_score = score.masked_fill(~going, float("-inf")).sort(dim=1, descending=True, stable=True)
        kept = allocate(banks.gather(1, by_score), going.gather(1, by_score), k, automata.max_tokens + 1)
        place = torch.where(kept, 0, m) + torch.arange(m, device=device)
        first_k = place.topk(k, dim=1, largest=False).indices  # the kept, best first, then padding
        chosen, alive = by_score.gather(1, first_k), kept.gather(1, first_k)  # (n, K)
        beam_scores = torch.where(alive, score.gather(1, chosen), float("-inf"))
        reorder = beam.gather(1, chosen) + (torch.arange(n, device=device) * k).unsqueeze(1)  # rows of this step
        prev = token.gather(1, chosen).clamp(max=model.tgt_vocab_size - 1)
        node, just_met = cand_node.gather(1, chosen), cand_met.gather(1, chosen) & alive
        count = cand_count.gather(1, chosen.unsqueeze(-1).expand(n, k, cand_count.size(-1)))
        before = cand_before.gather(1, chosen.unsqueeze(-1).expand(n, k, cand_count.size(-1)))
        if keep < n:  # drop the sentences that are done
            active, beam_scores, reorder, prev = active[searching], beam_scores[searching], reorder[searching], prev[searching]
            node, count, before, just_met = node[searching], count[searching], before[searching], just_met[searching]
            memory = select(memory, searching.nonzero().squeeze(1))
        reorder, prev = reorder.reshape(-1), prev.reshape(-1)
        history = torch.cat([history.index_select(0, reorder), prev.unsqueeze(1)], 1)
        state = select(state, reorder)
    for i in fell_back.nonzero().flatten().tolist():
        log.warning("constrained search: no hypothesis of sentence %d holds all %d constraints within the cap of %d "
                    "tokens; returning the best one", i, len(phrases[i]), cap_list[i])
    nbest_out = None
    if nbest > 1:
        ranked = to_lists(best_tokens.view(batch * n_best, -1))
        scores = best_scores.tolist()
        nbest_out = [[(ranked[i * n_best + r], scores[i][r]) for r in range(nbest) if scores[i][r] > float("-inf")]
                     for i in range(batch)]
    return Hypotheses(to_lists(best_tokens[:, 0]), best_scores[:, 0], None, nbest_out)

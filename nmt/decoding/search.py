"""Greedy search, sampling and batched beam search (with n-best lists): the only decoding code,
for every model; and the teacher-forced scoring of given translations.

All drive a model through the ``Seq2Seq`` interface (``encode``, ``init_state``,
``decode_step``; ``forward`` for scoring), normalise its logits through its ``kernels``
(``nmt.kernels``) and reorder its memory/state with ``nmt.models.base.select``, so they never
ask which architecture they decode. Outputs are capped
at ``max_len_a * source_length + max_len_b`` tokens, or at given per-sentence caps where those are
smaller (EOS forced at the cap). Greedy and beam search run here step by step, or on fixed shapes
(``nmt.decoding.fixed_beam``: the same results, built for GPUs) where their ``engine`` says; what
every search computes alike is in ``nmt.decoding.scoring``.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from nmt.specials import BOS, EOS, PAD
from nmt.models.base import select
from nmt.decoding import fixed_beam
from nmt.decoding.fixed_beam import fixed_beam_search
from nmt.decoding.scoring import (Hypotheses, best_possible, check_prefix, force_tokens, hf_penalty,  # noqa: F401
                                  hf_stops, length_cap, length_penalty, log_probs, max_lengths, to_lists,
                                  top_candidates)
from nmt.decoding.settings import DEFAULT_ALPHA, ENGINES, GRAPH_CACHE_MB, SCORINGS, SearchSettings

log = logging.getLogger(__name__)

# The fixed shapes check themselves on a GPU (where ``auto`` turns them on): a model's first fixed-shape
# searches there also run the loop, until one of them replayed a kept capture (a new batch in captured
# tensors, where the classic CUDA graph bugs show) or CHECKED_SEARCHES ran; a search whose share of
# sentences unlike the loop's (other tokens, or a score off by more than SCORE_TOLERANCE of it) is over
# SHARE_TOLERANCE turns the model to the loop for good, with one warning. Near-ties may flip a token
# between two correct searches in reduced precision; a broken replay changes nearly every sentence.
CHECKED_SEARCHES = 3
SHARE_TOLERANCE = 0.2
SCORE_TOLERANCE = 0.05


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)


def _forced(x: Tensor, prefix: Tensor | None, t: int, rows: Tensor | None = None, beams: int = 1,
            zero: bool = False) -> Tensor:
    """Log-probs ``x`` (rows * beams, W) where step ``t`` is inside a sentence's target prefix
    (``prefix`` (B, P), PAD after its end; ``rows``: the batch rows still decoding): every token
    but the prefix's is -inf there, and the prefix token keeps the model's log-prob (scores stay
    the model's), or gets 0 with ``zero`` (``scoring=huggingface``)."""
    if prefix is None or t >= prefix.size(1):
        return x
    token = prefix[:, t] if rows is None else prefix[rows, t]
    token = token.repeat_interleave(beams)
    if not bool((token != PAD).any()):
        return x
    return force_tokens(x, token, zero)


def _sequential_search(model, src: Tensor, src_mask: Tensor, pick: Callable[[Tensor], Tensor], max_len_a: float,
                       max_len_b: int, need_attn: bool, max_len: Tensor | None = None,
                       prefix: Tensor | None = None) -> Hypotheses:
    """One hypothesis per sentence, a token at a time: ``pick(log_probs (B, W)) -> tokens (B,)``;
    the score is the sum of the model's log-probs of the picked tokens. ``prefix`` (B, P): each
    sentence's output starts with these tokens (PAD-padded; see ``_forced``)."""
    batch = src.size(0)
    max_len = max_lengths(src_mask, max_len_a, max_len_b, max_len)
    check_prefix(prefix, max_len)
    memory = model.encode(src, src_mask)
    state = model.init_state(memory)
    prev = src.new_full((batch,), BOS)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    scores = torch.zeros(batch, device=src.device)
    tokens, attns = [], []
    for t in range(int(max_len.max())):
        logits, state, attn = model.decode_step(prev, memory, state, need_attn=need_attn)
        need_attn = need_attn and attn is not None  # models without attention give None
        x = _forced(log_probs(logits, model.tgt_vocab_size, model.kernels), prefix, t)
        token = pick(x)
        at_cap = t >= max_len - 1
        token = torch.where(at_cap & ~finished, torch.full_like(token, EOS), token)
        scores += x.gather(1, token.unsqueeze(1)).squeeze(1).masked_fill(finished, 0.0)
        tokens.append(token.masked_fill(finished, PAD))
        if need_attn:
            attns.append(attn.float())
        finished |= token == EOS
        if bool(finished.all()):
            break
        prev = token
    token_lists = to_lists(torch.stack(tokens, 1))
    attn_out = None
    if need_attn and attns:
        stacked = torch.stack(attns, 1)  # (B, T, S)
        attn_out = [stacked[i, : len(toks) + 1].cpu() for i, toks in enumerate(token_lists)]
    return Hypotheses(token_lists, scores, attn_out)


def _fixed_engine(engine: str, model, src: Tensor, src_mask: Tensor, max_len_a: float, max_len_b: int,
                  max_len: Tensor | None, need_attn: bool, scoring: str = "gnmt") -> str | None:
    """The fixed-shape engine (``fixed`` or ``graphs``) a greedy or beam search of ``engine`` runs
    on, or None for the loop: ``auto`` is ``graphs`` on CUDA; a search asked for attention weights, a
    model without a preallocated state, outputs longer than its positions, a beam search with
    ``scoring=huggingface`` (logged once) and a model whose self-check failed (``fell_back``) take
    the loop."""
    if engine not in ENGINES:
        raise ValueError(f"decoding.engine={engine!r}: choose one of {', '.join(ENGINES)}")
    if engine == "auto":
        engine = "graphs" if src.is_cuda else "loop"
    if engine == "loop" or need_attn:
        return None
    if scoring == "huggingface":
        _log_once(f"decoding.engine={engine}: beam search with scoring=huggingface runs on the loop engine (the fixed "
                  "shapes rank hypotheses with the GNMT penalty only)")
        return None
    positions = getattr(model, "fixed_state_steps", 0)
    if positions <= 0 or fell_back(model):
        return None
    # a source as wide as the batch bounds every sentence's cap (+1: float rounding), known without a read
    if int(max_len_a * src.size(1) + max_len_b) + 1 > positions and \
            int(max_lengths(src_mask, max_len_a, max_len_b, max_len).max()) > positions:
        return None
    return engine


@dataclass
class _EngineCheck:
    """Where a model's self-check of the fixed shapes stands."""

    searches: int = 0  # checked so far
    replayed: bool = False  # one of them replayed a kept capture
    loop: bool = False  # the fixed shapes disagreed: the loop from here on


_CHECKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _checked(model, src: Tensor, engine: str, fixed: Callable[[], Hypotheses], loop: Callable[[], Hypotheses]) -> Hypotheses:
    """``fixed()``'s hypotheses; while ``model``'s self-check is under way on a GPU (``CHECKED_SEARCHES``),
    also ``loop()``'s, compared: the loop's if they disagree, and the model takes the loop from then on."""
    check = _CHECKS.get(model) or _EngineCheck()
    if not fixed_beam._captures(src.device) or check.replayed or check.searches >= CHECKED_SEARCHES:
        return fixed()
    _CHECKS[model] = check
    restarts = fixed_beam.restarts(model)
    got, want = fixed(), loop()
    check.searches += 1
    check.replayed = fixed_beam.restarts(model) > restarts
    differ = disagreement(got, want)
    if differ <= SHARE_TOLERANCE:
        return got
    check.loop = True
    fixed_beam.release(model)
    log.warning("decoding.engine=%s: the fixed-shape search differs from the loop on %.0f%% of a checked batch's %d "
                "sentences (tolerance %.0f%%); this model decodes with the loop engine from here on", engine,
                100 * differ, len(want.tokens), 100 * SHARE_TOLERANCE)
    return want


def disagreement(got: Hypotheses, want: Hypotheses) -> float:
    """The share of sentences whose best hypothesis in ``got`` is not ``want``'s: other tokens, or a score
    off by more than ``SCORE_TOLERANCE`` of ``want``'s."""
    scores = zip(got.scores.float().tolist(), want.scores.float().tolist())
    differ = [a != b or abs(x - y) > SCORE_TOLERANCE * max(1.0, abs(y)) for a, b, (x, y) in zip(got.tokens, want.tokens, scores)]
    return sum(differ) / max(1, len(differ))


def fell_back(model) -> bool:
    """Whether ``model``'s fixed-shape searches disagreed with the loop in its self-check (it decodes
    with the loop since)."""
    check = _CHECKS.get(model)
    return check is not None and check.loop


@torch.no_grad()
def greedy_search(
    model, src: Tensor, src_mask: Tensor, max_len_a: float = 1.5, max_len_b: int = 10, need_attn: bool = False,
    max_len: Tensor | None = None, prefix: Tensor | None = None, engine: str = "auto",
    graph_cache_mb: float = GRAPH_CACHE_MB,
) -> Hypotheses:
    """Pick the most probable token at every step. src, src_mask: (B, S); ``max_len`` (B,): caps
    below the source-length ones (validation's, from the references); ``prefix`` (B, P): target
    tokens each output starts with (PAD-padded). ``engine``, ``graph_cache_mb``: as ``beam_search``'s;
    on fixed shapes greedy search is beam search with one beam and no length penalty (the same tokens
    and scores)."""
    fixed = _fixed_engine(engine, model, src, src_mask, max_len_a, max_len_b, max_len, need_attn)
    if fixed is not None:
        return _checked(model, src, fixed,
                        lambda: fixed_beam_search(model, src, src_mask, 1, 0.0, max_len_a, max_len_b, 1, max_len, prefix,
                                                  graphs=fixed == "graphs", graph_cache_mb=graph_cache_mb),
                        lambda: greedy_search(model, src, src_mask, max_len_a, max_len_b, False, max_len, prefix, "loop"))
    return _sequential_search(model, src, src_mask, lambda x: x.argmax(dim=-1), max_len_a, max_len_b, need_attn,
                              max_len, prefix)


def _sampler(temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> Callable[[Tensor], Tensor]:
    """Draw from softmax(log_probs / temperature), restricted to the ``top_k`` most probable tokens
    (0: all) and to the smallest set whose probability reaches ``top_p`` (nucleus; 1: all).
    A temperature of 0 is greedy."""

    def pick(x: Tensor) -> Tensor:
        if temperature <= 0:
            return x.argmax(dim=-1)
        logits = x / temperature
        if 0 < top_k < logits.size(-1):
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)  # mass of the better tokens
            drop = (before >= top_p).scatter(1, order, before >= top_p)
            logits = logits.masked_fill(drop, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)

    return pick


@torch.no_grad()
def sample_search(
    model, src: Tensor, src_mask: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
    max_len_a: float = 1.5, max_len_b: int = 10, need_attn: bool = False, max_len: Tensor | None = None,
    prefix: Tensor | None = None,
) -> Hypotheses:
    """One sampled translation per sentence (back-translation, data augmentation), with
    temperature, top-k and top-p (Holtzman et al. 2020). The draws come from a generator seeded
    with ``seed`` and the batch's source ids, so the same input, seed and batching give the same
    output. Scores are the model's log-probs of the drawn tokens (before temperature)."""
    if not 0.0 < top_p <= 1.0 or top_k < 0 or temperature < 0:
        raise ValueError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1 "
                         f"(got temperature={temperature}, top_k={top_k}, top_p={top_p})")
    generator = torch.Generator(device=src.device)
    generator.manual_seed(hash((int(seed), tuple(src.shape), int(src.sum()))) & 0xFFFF_FFFF_FFFF)
    pick = _sampler(float(temperature), int(top_k), float(top_p), generator)
    return _sequential_search(model, src, src_mask, pick, max_len_a, max_len_b, need_attn, max_len, prefix)


@torch.no_grad()
def score_pairs(model, src: Tensor, src_mask: Tensor, tgt: Tensor) -> Tensor:
    """Log-probability of each given target token under the model, (B, T), teacher-forced
    through ``model.forward``: ``tgt`` (B, T) holds the target ids followed by EOS, PAD-padded
    (0 where padded). The same distribution as decoding's (PAD and BOS never generated), so the
    sum over a sentence equals the score greedy search gives its own output."""
    tgt_in = torch.cat([tgt.new_full((tgt.size(0), 1), BOS), tgt[:, :-1]], 1)
    tgt_in = tgt_in.masked_fill(tgt_in == EOS, PAD)  # after a shorter sentence's EOS
    x = log_probs(model(src, src_mask, tgt_in), model.tgt_vocab_size, model.kernels)
    return x.gather(-1, tgt.unsqueeze(-1)).squeeze(-1).masked_fill(tgt == PAD, 0.0)


@torch.no_grad()
def beam_search(
    model,
    src: Tensor,
    src_mask: Tensor,
    beam_size: int = 5,
    alpha: float | None = DEFAULT_ALPHA,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    need_attn: bool = False,
    nbest: int = 1,
    max_len: Tensor | None = None,
    prefix: Tensor | None = None,
    engine: str = "auto",
    scoring: str = "gnmt",
    early_stopping: bool | str = False,
    graph_cache_mb: float = GRAPH_CACHE_MB,
) -> Hypotheses:
    """Batched beam search (``prefix`` (B, P): target tokens every hypothesis of a sentence starts
    with, PAD-padded); a sentence stops once ``beam_size`` hypotheses have ended, or once
    none of its live hypotheses can still beat its ``nbest``-th best (which changes no result),
    and then leaves the batch (the others decode on fewer rows); the search stops when every
    sentence has. Hypotheses are ranked by score / length_penalty; ``nbest`` > 1 also returns
    each sentence's ``nbest`` best ended hypotheses (``Hypotheses.nbest``); ``alpha=None``:
    ``DEFAULT_ALPHA``.

    ``engine`` (``ENGINES``): ``loop``, this search, which reads the device every step and
    shrinks the batch as sentences end; ``fixed`` and ``graphs``, the same search on tensors of
    fixed shapes (``nmt.decoding.fixed_beam``: the same hypotheses and scores), ``graphs`` padded
    to a bounded set of shapes and, on CUDA, replayed as one CUDA graph per step; ``auto``:
    ``graphs`` on CUDA, ``loop`` elsewhere. A search the fixed shapes do not serve (attention
    weights asked for, a model without a preallocated state, outputs longer than the decoder's
    positions) runs the loop.

    ``scoring`` (``SCORINGS``): ``gnmt``, the above; ``huggingface``, Hugging Face transformers'
    beam search as ``generate()`` runs it: an ended hypothesis scores its log-prob sum divided by
    ``|Y| ** alpha`` (``hf_penalty``), forced tokens (``prefix``, the EOS at the length cap) add
    log-prob 0, the best ``beam_size`` ended hypotheses are kept, and a sentence stops by
    transformers' rule (``hf_stops`` with ``early_stopping``), which can stop before a longer
    hypothesis would have won; on the loop engine only."""
    alpha = DEFAULT_ALPHA if alpha is None else alpha
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"nbest={nbest}: must be between 1 and the beam size ({beam_size})")
    if scoring not in SCORINGS:
        raise ValueError(f"decoding.scoring={scoring!r}: choose one of {', '.join(SCORINGS)}")
    hf = scoring == "huggingface"
    fixed = _fixed_engine(engine, model, src, src_mask, max_len_a, max_len_b, max_len, need_attn, scoring)
    if fixed is not None:
        return _checked(model, src, fixed,
                        lambda: fixed_beam_search(model, src, src_mask, beam_size, alpha, max_len_a, max_len_b, nbest,
                                                  max_len, prefix, graphs=fixed == "graphs", graph_cache_mb=graph_cache_mb),
                        lambda: beam_search(model, src, src_mask, beam_size, alpha, max_len_a, max_len_b, False, nbest,
                                            max_len, prefix, "loop", scoring, early_stopping))
    batch, k, n_best = src.size(0), beam_size, (beam_size if hf else nbest)  # transformers keeps K ended
    device = src.device
    max_len = max_lengths(src_mask, max_len_a, max_len_b, max_len)
    check_prefix(prefix, max_len)
    steps = int(max_len.max())
    # One copy of a sentence's memory serves its K beams (rows s*K .. s*K + K - 1 of the state):
    # attention reads it once for all of them.
    memory = model.encode(src, src_mask)  # (B, ...)
    state = select(model.init_state(memory), torch.arange(batch, device=device).repeat_interleave(k))  # (B*K, ...)
    prev = src.new_full((batch * k,), BOS)
    beam_scores = torch.full((batch, k), float("-inf"), device=device)
    beam_scores[:, 0] = 0.0  # all beams start identical: keep one
    history = src.new_zeros(batch * k, 0)  # (B*K, t)
    attn_hist = None
    # The n_best best ended hypotheses of each sentence, best first.
    best_scores = torch.full((batch, n_best), float("-inf"), device=device)
    best_tokens = src.new_full((batch, n_best, steps + 1), PAD)
    best_attn = src.new_zeros((batch, n_best, steps + 1, src.size(1)), dtype=torch.float) if need_attn else None
    # Sentences still searching (their rows in the batch-sized tensors above); a sentence whose
    # search has ended leaves the decoder's batch, so the rest decode on fewer rows.
    active = torch.arange(batch, device=device)
    num_finished = torch.zeros(batch, dtype=torch.long, device=device)
    offsets = (torch.arange(batch, device=device) * k).unsqueeze(1)  # (B, 1)
    beam_pos = torch.arange(2 * k, device=device) < k
    for t in range(steps):
        n = active.numel()
        logits, state, attn = model.decode_step(prev, memory, state, need_attn=need_attn)
        if need_attn and attn is None:  # a model without attention
            need_attn, best_attn = False, None
        x = _forced(log_probs(logits, model.tgt_vocab_size, model.kernels), prefix, t, active, k, hf)  # (n*K, W)
        width = x.size(-1)
        at_cap = t >= max_len - 1  # (n,)
        if bool(at_cap.any()):  # only EOS may follow at the length cap
            not_eos = torch.arange(width, device=device) != EOS
            capped = at_cap.repeat_interleave(k).unsqueeze(1)
            x = x.masked_fill(capped & not_eos, float("-inf"))
            if hf:  # transformers' forced EOS: log-prob 0
                x = x.masked_fill(capped & ~not_eos, 0.0)
        top_scores, top_idx = top_candidates(x, beam_scores, 2 * k)  # (n, 2K)
        origin = top_idx // width + offsets[:n]  # flat beam index (n, 2K)
        # a -inf candidate may point at a padding column; it never ends nor wins, but is fed back
        token = (top_idx % width).clamp_(max=model.tgt_vocab_size - 1)
        if need_attn:
            step_attn = attn.float().unsqueeze(1)
            attn_hist = step_attn if attn_hist is None else torch.cat([attn_hist, step_attn], 1)
        # Hypotheses ending here: EOS among the K best candidates.
        ended = (token == EOS) & beam_pos & (top_scores > float("-inf"))
        penalty = (hf_penalty if hf else length_penalty)(torch.tensor(t + 1, device=device), alpha)
        norm = (top_scores / penalty).masked_fill(~ended, float("-inf"))
        norm = norm[:, :k]  # only the K best candidates end
        improve = norm.max(dim=1).values > best_scores[active, -1]  # (n,): enters the n-best list
        if bool(improve.any()):
            rows = active[improve]
            m, length = rows.numel(), best_tokens.size(-1)
            merged, pick = torch.cat([best_scores[rows], norm[improve]], 1).topk(n_best, dim=1)  # (m, n_best)
            src_beams = origin[improve, :k].reshape(-1)  # (m * K,)
            cand_tokens = src.new_full((m, k, length), PAD)
            cand_tokens[:, :, :t] = history.index_select(0, src_beams).view(m, k, t)
            pool = torch.cat([best_tokens[rows], cand_tokens], 1)  # (m, n_best + K, L)
            best_tokens[rows] = pool.gather(1, pick.unsqueeze(-1).expand(m, n_best, length))
            best_scores[rows] = merged
            if need_attn:
                cand_attn = best_attn.new_zeros((m, k, *best_attn.shape[2:]))
                cand_attn[:, :, : t + 1] = attn_hist.index_select(0, src_beams).view(m, k, t + 1, -1)
                pool_attn = torch.cat([best_attn[rows], cand_attn], 1)
                best_attn[rows] = pool_attn.gather(1, pick[..., None, None].expand(m, n_best, *best_attn.shape[2:]))
        num_finished += ended.sum(1)
        # The K best candidates that did not end continue.
        alive_scores = top_scores.masked_fill(token == EOS, float("-inf"))
        beam_scores, keep = alive_scores.topk(k, dim=1)  # (n, K)
        # A sentence searches on until beam_size hypotheses have ended, or until none of its
        # live ones can still beat the last of its n best.
        if hf:
            searching = ~hf_stops(best_scores[active, -1], beam_scores[:, 0], t, max_len, alpha, early_stopping,
                                  num_finished, k)
        else:
            searching = (num_finished < k) & (best_scores[active, -1] < best_possible(beam_scores[:, 0], t, max_len, alpha))
        if not bool(searching.any()):
            break
        reorder = origin.gather(1, keep)  # (n, K), rows of the current batch
        prev = token.gather(1, keep)
        shrink = not bool(searching.all())
        if shrink:  # drop the sentences that are done
            active, max_len, num_finished = active[searching], max_len[searching], num_finished[searching]
            beam_scores, reorder, prev = beam_scores[searching], reorder[searching], prev[searching]
            memory = select(memory, searching.nonzero().squeeze(1))
        reorder, prev = reorder.reshape(-1), prev.reshape(-1)
        history = torch.cat([history.index_select(0, reorder), prev.unsqueeze(1)], 1)
        if need_attn:
            attn_hist = attn_hist.index_select(0, reorder)
        state = select(state, reorder)
    token_lists = to_lists(best_tokens[:, 0])
    attn_out = None
    if need_attn:
        attn_out = [best_attn[i, 0, : len(toks) + 1].cpu() for i, toks in enumerate(token_lists)]
    nbest_out = None
    if nbest > 1:
        ranked = to_lists(best_tokens.view(batch * n_best, -1))
        scores = best_scores.tolist()
        nbest_out = [[(ranked[i * n_best + r], scores[i][r]) for r in range(nbest) if scores[i][r] > float("-inf")]
                     for i in range(batch)]
    return Hypotheses(token_lists, best_scores[:, 0], attn_out, nbest_out)


def search_of(settings: SearchSettings, beam_size: int | None = None, nbest: int | None = None) -> Callable[..., Hypotheses]:
    """The search function of ``settings``, or beam search (greedy for a beam of 1) with its
    length limits for another ``beam_size``/``nbest``."""
    beam_size = settings.beam_size if beam_size is None else int(beam_size)
    nbest = settings.nbest if nbest is None else int(nbest)
    limits = {"max_len_a": settings.max_len_a, "max_len_b": settings.max_len_b}
    if settings.search == "sample" and beam_size == settings.beam_size:
        return functools.partial(sample_search, **limits, **settings.sampling)
    limits["graph_cache_mb"] = settings.graph_cache_mb
    if beam_size == 1 and nbest == 1:
        return functools.partial(greedy_search, engine=settings.engine, **limits)
    alpha = DEFAULT_ALPHA if settings.alpha is None else settings.alpha  # None: settings not yet for_model'd
    return functools.partial(beam_search, beam_size=beam_size, alpha=alpha, nbest=nbest, engine=settings.engine,
                             scoring=settings.scoring or "gnmt", early_stopping=settings.early_stopping, **limits)

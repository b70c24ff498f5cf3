"""Beam search on tensors of fixed shapes, for GPUs: the search of ``search.beam_search`` (the same
hypotheses, scores and n-best lists) with nothing in a step that waits for the host.

``search.beam_search`` reads the device at every step (has a sentence ended? is any still
searching?) and shrinks its tensors as sentences end: cheap on a CPU, but on a GPU each read stalls
the queue of kernels and each new shape is a new launch plan. Here:

- **the decoder's state is preallocated** for the batch's longest output
  (``Seq2Seq.init_state(capacity=...)``: a Transformer's key/value cache, written in place at each
  step's position) in two copies that a step reads and writes in turn (the beams' reorder is one
  pass over the cache), so every tensor keeps its shape and address;
- **finished sentences stay in the batch**, their hypotheses frozen by a ``searching`` mask instead
  of leaving it, and every step's bookkeeping (the n-best lists, the finished counts, the stop
  test) stays on the device: the host reads one flag every ``CHECK_EVERY`` steps and the
  steps after the last sentence stopped change nothing;
- **a step reads the positions filled so far, to their bucket**: step t reads and reorders the
  first ``read_positions(t)`` positions of the cache (a power of two, at least ``MIN_READ``), views
  of the preallocated tensors (``Seq2Seq.narrow_state``), not the whole capacity;
- **with** ``graphs``, batches are padded to the shape ladder of training's buckets
  (``nmt.data.shapes``: rows, source length and output capacity), so a handful of shapes serve a
  whole test set, and on CUDA a step (decoder, normalisation, top-k, bookkeeping) is captured once
  per shape, copy of the state and bucket of positions read as a CUDA graph and replayed: one launch
  per step instead of hundreds. A model keeps its most recently used captured searches (their
  tensors and one shared memory pool) beside it, at most ``KEPT_SEARCHES`` and at most
  ``graph_cache_mb`` of their tensors (``decoding.graph_cache_mb``; a search larger than that alone
  runs its steps eagerly), until its weights move or ``release`` (training's after each validation
  and test, translate.py's at its end); a shape whose capture failed runs eagerly from then on.

A source longer than the encoder's positions is refused (the loop refuses it too), never cropped.
The steps run in the loop's order on the same values, so in fp32 the hypotheses are the loop's;
the attention over a preallocated cache adds masked positions, which change a float's last bits at
most (``tests/test_fixed_beam.py``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from nmt.data.shapes import bucket
from nmt.decoding.settings import GRAPH_CACHE_MB
from nmt.decoding.scoring import (Hypotheses, best_possible, check_prefix, force_tokens, length_penalty, log_probs,
                                  max_lengths, to_lists, top_candidates)
from nmt.models.base import Tree, select
from nmt.specials import BOS, EOS, PAD

CHECK_EVERY = 8  # steps between the host's reads of whether any sentence still searches
WARMUP_STEPS = 2  # eager steps before a CUDA graph is captured (lazy initialisation, autotuning)
KEPT_SEARCHES = 8  # captured searches kept per model at most, the most recently used ...
# ... within decoding.graph_cache_mb (``GRAPH_CACHE_MB`` by default) of their tensors
MIN_READ = 16  # the fewest cache positions a step reads (then powers of two: a graph per bucket)

_log = logging.getLogger(__name__)


@dataclass
class _Buffers:
    """A search's tensors, each of one shape and address for the whole search (and, captured, for
    every batch of its shape): n sentences of ``k`` beams, ``capacity`` steps at most."""

    memory: Tree
    prefix: Tensor | None  # (n, capacity) target tokens forced at each step, PAD where free
    caps: Tensor  # (n,) each sentence's most output tokens
    searching: Tensor  # (n,) bool: still searching (padding rows never do)
    t: Tensor  # (1,) the step
    prev: Tensor  # (n*k,) the previous token of each beam
    beam_scores: Tensor  # (n, k)
    history: Tensor  # (n*k, capacity) each beam's tokens, PAD after step t
    best_scores: Tensor  # (n, nbest) the best ended hypotheses, score / length penalty
    best_tokens: Tensor  # (n, nbest, capacity)
    num_finished: Tensor  # (n,)
    states: list[Tree] | None = None  # the decoder's, two copies a step reads and writes in turn (set by step 0)
    graphs: dict[tuple[int, int | None], Callable[[], None]] = field(default_factory=dict)  # captured, per
    # (parity, positions read)
    nbytes: int = 0  # of the tensors above, once kept


def fixed_beam_search(model, src: Tensor, src_mask: Tensor, beam_size: int, alpha: float, max_len_a: float,
                      max_len_b: int, nbest: int = 1, max_len: Tensor | None = None, prefix: Tensor | None = None,
                      graphs: bool = False, check_every: int = CHECK_EVERY,
                      graph_cache_mb: float = GRAPH_CACHE_MB) -> Hypotheses:
    """``search.beam_search`` on fixed shapes (module docstring); ``graphs``: padded to the shape
    ladder and, on CUDA, captured, the model's kept searches within ``graph_cache_mb`` MiB.
    ``beam_search`` sends here only batches whose outputs fit the decoder's positions
    (``Seq2Seq.fixed_state_steps``); a source longer than the encoder's positions is refused."""
    batch, k = src.size(0), beam_size
    limit = model.max_source_tokens
    if limit is not None and src.size(1) > limit:
        raise ValueError(f"a source of {src.size(1)} tokens: the encoder has positions for {limit}; shorten or split "
                         "it (translate.py and nmt-serve cut sources at the model's max_src_len)")
    caps = max_lengths(src_mask, max_len_a, max_len_b, max_len)
    check_prefix(prefix, caps)
    steps = int(caps.max())
    if steps > model.fixed_state_steps:
        raise ValueError(f"outputs of up to {steps} tokens: the decoder has positions for {model.fixed_state_steps}")
    capacity, rows, width = steps, batch, src.size(1)
    if graphs:  # each to its bucket, within the positions the decoder and the encoder have
        capacity = min(int(bucket(steps)), model.fixed_state_steps)
        rows, width = int(bucket(batch)), min(int(bucket(width)), limit or (1 << 62))
    src, src_mask, caps = _padded(src, src_mask, caps, rows, width)
    if prefix is not None:
        prefix = torch.nn.functional.pad(prefix[:, :capacity], (0, capacity - min(prefix.size(1), capacity),
                                                                0, rows - batch), value=PAD)
    memory = model.encode(src, src_mask)
    key = (rows, width, capacity, k, nbest, float(alpha), prefix is not None, _autocast_key(src.device),
           torch.is_inference_mode_enabled(), model.training, model.kernels.mode)
    if not (graphs and _captures(src.device)):
        b = _new_buffers(memory, prefix, caps, batch, k, nbest, capacity)
        _search(model, b, steps, k, nbest, float(alpha), memory, capacity, check_every)
        return _results(b, batch, nbest)
    with _CAPTURING:  # one search at a time writes a model's kept tensors
        kept = _kept(model)
        b = kept.searches.get(key)
        if b is None:
            b = _new_buffers(_cloned(memory), prefix, caps, batch, k, nbest, capacity)  # the caller's stay theirs
        else:
            kept.searches.move_to_end(key)
            kept.restarts += 1
            _copy_into(b.memory, memory)  # this batch into the kept search's tensors
            _restart(b, caps, prefix, batch, k)
        _search(model, b, steps, k, nbest, float(alpha), memory, capacity, check_every, kept, key,
                int(graph_cache_mb * (1 << 20)))
        return _results(b, batch, nbest)


def _results(b: _Buffers, batch: int, nbest: int) -> Hypotheses:
    """The hypotheses of the batch's ``batch`` real sentences (copies: the tensors are reused)."""
    token_lists = to_lists(b.best_tokens[:batch, 0])
    nbest_out = None
    if nbest > 1:
        ranked = to_lists(b.best_tokens[:batch].reshape(batch * nbest, -1))
        scores = b.best_scores[:batch].tolist()
        nbest_out = [[(ranked[i * nbest + r], scores[i][r]) for r in range(nbest) if scores[i][r] > float("-inf")]
                     for i in range(batch)]
    return Hypotheses(token_lists, b.best_scores[:batch, 0].clone(), None, nbest_out)


def _new_buffers(memory: Tree, prefix: Tensor | None, caps: Tensor, batch: int, k: int, nbest: int,
                 capacity: int) -> _Buffers:
    rows, device = caps.size(0), caps.device
    return _Buffers(
        memory=memory, prefix=prefix, caps=caps, searching=torch.arange(rows, device=device) < batch,
        t=torch.zeros(1, dtype=torch.long, device=device), prev=torch.full((rows * k,), BOS, device=device),
        beam_scores=_first_beams(rows, k, device), history=torch.full((rows * k, capacity), PAD, device=device),
        best_scores=torch.full((rows, nbest), float("-inf"), device=device),
        best_tokens=torch.full((rows, nbest, capacity), PAD, device=device),
        num_finished=torch.zeros(rows, dtype=torch.long, device=device))


def _search(model, b: _Buffers, steps: int, k: int, nbest: int, alpha: float, memory: Tree, capacity: int,
            check_every: int, kept: _Kept | None = None, key: tuple = (), budget: int = 0) -> None:
    """Run the search on ``b`` to its end: step 0 eagerly (from the state ``memory`` starts), then
    the others, replayed from the kept CUDA graph of ``key`` (captured after ``WARMUP_STEPS`` eager
    steps on a side stream the first time) where ``kept`` is given and ``b``'s tensors fit in
    ``budget`` bytes, eagerly otherwise."""
    rows = b.caps.size(0)
    state = select(model.init_state(memory, capacity=capacity), torch.arange(rows, device=b.caps.device).repeat_interleave(k))
    step = _Step(model, b, k, nbest, alpha)
    step(0, None, state)  # step 0, eagerly: it fixes the state's shapes and dtypes (an RNN's may change at the first step)
    narrows = model.narrow_state(b.states[0], capacity) is not None  # a state with positions (a key/value cache)
    capture = kept is not None and key not in kept.failed
    if capture and key not in kept.searches and _nbytes(b) > budget:
        _log.info("beam search runs the steps of a %.1f MiB search eagerly: over decoding.graph_cache_mb=%g",
                  _nbytes(b) / (1 << 20), budget / (1 << 20))
        kept.failed.add(key)
        capture = False
    side = _Stream(b.caps.device) if capture else None
    for t in range(1, steps):
        if t % check_every == 0 and not bool(b.searching.any()):
            break
        parity = t % 2  # the step reads states[parity] and writes states[1 - parity]
        reads = read_positions(t, capacity) if narrows else None
        run = partial(step, parity, reads)
        graph = b.graphs.get((parity, reads))
        if graph is not None:
            graph()
        elif capture and t > WARMUP_STEPS:
            try:
                graph = b.graphs[parity, reads] = _captured(run, side, kept)
            except RuntimeError as error:  # a step a graph cannot hold: eager steps, as correct, for this shape
                _log.warning("beam search runs its steps eagerly: a CUDA graph could not capture them (%s)",
                             str(error).splitlines()[0] if str(error) else type(error).__name__)
                kept.failed.add(key)
                capture = False
                run()
                continue
            kept.keep(key, b, budget)
            graph()
        elif capture:
            side.run(run)
        else:
            run()


def read_positions(t: int, capacity: int) -> int:
    """The cache positions step ``t`` reads (it writes position t): the power of two at least t + 1
    and ``MIN_READ``, within ``capacity``."""
    return min(capacity, max(MIN_READ, 1 << t.bit_length()))


class _Step:
    """One step of the search on ``b``'s tensors, in place (the loop's step in ``search.beam_search``,
    with every data-dependent branch a mask)."""

    def __init__(self, model, b: _Buffers, k: int, nbest: int, alpha: float) -> None:
        self.model, self.b, self.k, self.nbest, self.alpha = model, b, k, nbest, alpha

    def __call__(self, parity: int, reads: int | None = None, state: Tree | None = None) -> None:
        """The step from ``b.states[parity]`` (step 0: from ``state``) into ``b.states[1 - parity]``:
        reordering the beams' states is one pass over them, a read of one copy and a write of the
        other; ``reads``: over their first ``reads`` positions only (None: all of them)."""
        model, b, k = self.model, self.b, self.k
        n = b.caps.size(0)
        if state is None:
            state = b.states[parity] if reads is None else model.narrow_state(b.states[parity], reads)
        logits, state, _ = model.decode_step(b.prev, b.memory, state)
        x = log_probs(logits, model.tgt_vocab_size, model.kernels)  # (n*k, W)
        if b.prefix is not None:
            x = force_tokens(x, b.prefix.index_select(1, b.t).squeeze(1).repeat_interleave(k))
        width = x.size(-1)
        at_cap = (b.t >= b.caps - 1).repeat_interleave(k).unsqueeze(1)  # only EOS may follow at the cap
        x = x.masked_fill(at_cap & (torch.arange(width, device=x.device) != EOS), float("-inf"))
        top_scores, top_idx = top_candidates(x, b.beam_scores, 2 * k)  # (n, 2k)
        origin = top_idx // width + (torch.arange(n, device=x.device) * k).unsqueeze(1)
        token = (top_idx % width).clamp_(max=model.tgt_vocab_size - 1)
        first_k = torch.arange(2 * k, device=x.device) < k
        ended = (token == EOS) & first_k & (top_scores > float("-inf")) & b.searching.unsqueeze(1)
        norm = (top_scores / length_penalty(b.t + 1, self.alpha)).masked_fill(~ended, float("-inf"))[:, :k]
        improve = norm.max(dim=1).values > b.best_scores[:, -1]  # (n,): enters the n-best list
        merged, pick = torch.cat([b.best_scores, norm], 1).topk(self.nbest, dim=1)
        length = b.history.size(1)
        candidates = b.history.index_select(0, origin[:, :k].reshape(-1)).view(n, k, length)
        pool = torch.cat([b.best_tokens, candidates], 1).gather(1, pick.unsqueeze(-1).expand(n, self.nbest, length))
        b.best_tokens.copy_(torch.where(improve[:, None, None], pool, b.best_tokens))
        b.best_scores.copy_(torch.where(improve[:, None], merged, b.best_scores))
        b.num_finished.add_(ended.sum(1))
        beam_scores, keep = top_scores.masked_fill(token == EOS, float("-inf")).topk(k, dim=1)  # (n, k)
        still = (b.num_finished < k) & (b.best_scores[:, -1] < best_possible(beam_scores[:, 0], b.t, b.caps,
                                                                                     self.alpha))
        b.searching.logical_and_(still)
        reorder = origin.gather(1, keep).view(-1)
        b.prev.copy_(token.gather(1, keep).view(-1))
        b.beam_scores.copy_(beam_scores)
        b.history.copy_(b.history.index_select(0, reorder))
        b.history.index_copy_(1, b.t, b.prev.unsqueeze(1))
        if b.states is None:  # step 0 of a new search: the states' shapes and dtypes from here on
            ahead = select(state, reorder)
            b.states = [_cloned(ahead), ahead]
        else:
            _select_into(b.states[1 - parity] if reads is None else model.narrow_state(b.states[1 - parity], reads),
                         state, reorder)
        b.t.add_(1)


def _first_beams(rows: int, k: int, device: torch.device) -> Tensor:
    scores = torch.full((rows, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: keep one
    return scores


def _padded(src: Tensor, src_mask: Tensor, caps: Tensor, rows: int, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """The batch padded to ``rows`` sentences of ``width`` tokens: PAD columns, and rows of one EOS
    (capped at one token) that never search."""
    batch, length = src.shape
    if (rows, width) == (batch, length):
        return src, src_mask, caps
    src = torch.nn.functional.pad(src, (0, width - length, 0, rows - batch), value=PAD)
    src_mask = torch.nn.functional.pad(src_mask, (0, width - length, 0, rows - batch), value=False)
    src[batch:, 0], src_mask[batch:, 0] = EOS, True
    return src, src_mask, torch.nn.functional.pad(caps, (0, rows - batch), value=1)


def _restart(b: _Buffers, caps: Tensor, prefix: Tensor | None, batch: int, k: int) -> None:
    """A kept search's tensors set for a new batch of its shape."""
    rows = caps.size(0)
    b.caps.copy_(caps)
    if prefix is not None:
        b.prefix.copy_(prefix)
    b.searching.copy_(torch.arange(rows, device=caps.device) < batch)
    b.t.zero_()
    b.prev.fill_(BOS)
    b.beam_scores.copy_(_first_beams(rows, k, caps.device))
    b.history.fill_(PAD)
    b.best_scores.fill_(float("-inf"))
    b.best_tokens.fill_(PAD)
    b.num_finished.zero_()


def _select_into(dst: Tree, src: Tree, index: Tensor) -> None:
    """Rows ``index`` of every tensor of ``src`` written into the tensor at the same place in
    ``dst`` (``select`` without a new tensor); other leaves stay ``dst``'s."""
    if isinstance(dst, Tensor):
        if dst.shape[1:] != src.shape[1:] or dst.size(0) != index.numel() or dst.dtype != src.dtype:
            raise RuntimeError(f"a fixed-shape search's tensor changed from {tuple(dst.shape)} {dst.dtype} to "
                               f"{tuple(src.shape)} {src.dtype} between steps")
        torch.index_select(src, 0, index, out=dst)  # dst may be a view (a cache's first positions): written in place
    elif isinstance(dst, dict):
        for key, value in dst.items():
            _select_into(value, src[key], index)
    elif isinstance(dst, (list, tuple)):
        for a, c in zip(dst, src, strict=True):
            _select_into(a, c, index)


def _copy_into(dst: Tree, src: Tree) -> None:
    """Copy every tensor of ``src`` into the tensor at the same place in ``dst`` (the same shapes and
    dtypes: a step that changed them would break the fixed shapes); other leaves stay ``dst``'s."""
    if isinstance(dst, Tensor):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise RuntimeError(f"a fixed-shape search's tensor changed from {tuple(dst.shape)} {dst.dtype} to "
                               f"{tuple(src.shape)} {src.dtype} between steps")
        dst.copy_(src)
    elif isinstance(dst, dict):
        for key, value in dst.items():
            _copy_into(value, src[key])
    elif isinstance(dst, (list, tuple)):
        for a, c in zip(dst, src, strict=True):
            _copy_into(a, c)


# --- CUDA graphs -------------------------------------------------------------------------------

def _captures(device: torch.device) -> bool:
    """Whether steps on ``device`` are captured as CUDA graphs (elsewhere they run eagerly)."""
    return device.type == "cuda"


class _Stream:
    """Warm-up steps on a side stream of the search's device, as a capture needs (``torch.cuda.graphs``'
    recipe)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def run(self, fn: Callable[[], None]) -> None:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            fn()
        current.wait_stream(self.stream)


def _captured(step: Callable[[], None], side: _Stream, kept: _Kept) -> Callable[[], None]:
    """``step`` captured as a CUDA graph (recorded, not run) in the model's memory pool: its replay.
    Autocast's cache of cast weights is off while capturing, so the graph casts them itself and never
    reads a freed cast; the capture is this thread's alone (``thread_local``), so a data loader's
    threads pinning memory meanwhile do not break it; a failed capture gives the stream back."""
    graph = torch.cuda.CUDAGraph()
    kind = "cuda"
    current = torch.cuda.current_stream(side.device)
    if kept.pool is None:
        kept.pool = torch.cuda.graph_pool_handle()
    try:
        with torch.cuda.device(side.device), torch.autocast(
                kind, dtype=torch.get_autocast_dtype(kind), enabled=torch.is_autocast_enabled(kind), cache_enabled=False):
            with torch.cuda.graph(graph, pool=kept.pool, stream=side.stream, capture_error_mode="thread_local"):
                step()
    except BaseException:
        torch.cuda.set_stream(current)
        kept.pool = None  # later captures start a pool of their own
        raise
    return graph.replay


def _autocast_key(device: torch.device) -> tuple:
    kind = device.type
    return (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) if kind == "cuda" else (False, None)


def _weights_key(model) -> tuple:
    """Where the model's weights and buffers are and how often the weights changed in place: a
    captured graph reads them at fixed addresses, so a move retires it (an in-place change it reads
    live; what ``encode`` prepares from them is copied in for every batch)."""
    return (tuple((p.data_ptr(), 0 if p.is_inference() else p._version) for p in model.parameters()),
            tuple(x.data_ptr() for x in model.buffers()))


class _Kept:
    """A model's captured searches, by batch shape (most recently used last, at most
    ``KEPT_SEARCHES`` and a budget of bytes), the shapes whose capture failed (or that were over the
    budget alone), the memory pool their graphs share, and the weights they read."""

    def __init__(self, weights: tuple) -> None:
        self.weights = weights
        self.searches: OrderedDict[tuple, _Buffers] = OrderedDict()
        self.failed: set[tuple] = set()
        self.pool = None
        self.restarts = 0  # searches run in kept tensors (a new batch where a captured one was)

    def keep(self, key: tuple, b: _Buffers, budget: int) -> None:
        """Keep ``b`` (within ``budget`` bytes alone), dropping the least recently used others over
        ``KEPT_SEARCHES`` or the budget."""
        b.nbytes = b.nbytes or _nbytes(b)
        self.searches[key] = b
        self.searches.move_to_end(key)
        while len(self.searches) > 1 and (len(self.searches) > KEPT_SEARCHES or self.nbytes() > budget):
            self.searches.popitem(last=False)

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.searches.values())


# Per model (weakly held, so a copy of a model copies none of them); a lock for the searches that
# write a model's kept tensors (a server decodes in one thread, but nothing here relies on it).
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CAPTURING = threading.Lock()


def kept_shapes(model) -> list[tuple]:
    """The batch shapes whose captured searches ``model`` keeps."""
    kept = _KEPT.get(model)
    return [] if kept is None else list(kept.searches)


def restarts(model) -> int:
    """How many searches ran in ``model``'s kept tensors since they were last emptied."""
    kept = _KEPT.get(model)
    return 0 if kept is None else kept.restarts


def kept_bytes(model) -> int:
    """The bytes of the tensors of ``model``'s kept searches (their graphs' scratch memory aside)."""
    kept = _KEPT.get(model)
    return 0 if kept is None else kept.nbytes()


def release(model) -> None:
    """Drop ``model``'s captured searches and their memory (training calls it after each validation
    and test: its weights change before the next one)."""
    with _CAPTURING:
        _KEPT.pop(model, None)


def _kept(model) -> _Kept:
    """``model``'s captured searches, emptied if its weights moved since they were captured."""
    weights = _weights_key(model)
    kept = _KEPT.get(model)
    if kept is None or kept.weights != weights:
        kept = _KEPT[model] = _Kept(weights)
    return kept


def _nbytes(b: _Buffers) -> int:
    """The bytes of ``b``'s tensors (memory, states, bookkeeping), each storage once."""
    storages = {}
    for x in _leaves([b.memory, b.prefix, b.caps, b.searching, b.t, b.prev, b.beam_scores, b.history, b.best_scores,
                      b.best_tokens, b.num_finished, b.states]):
        storage = x.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _leaves(tree) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    return [x for part in tree for x in _leaves(part)] if isinstance(tree, (list, tuple)) else []


def _cloned(tree: Tree) -> Tree:
    """``tree`` with each tensor copied (other leaves shared)."""
    if isinstance(tree, Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloned(value) for value in tree)
    return tree

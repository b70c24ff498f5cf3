"""Which keys a Transformer self-attention query reads: the attention patterns of
``model.encoder.attention`` and ``model.decoder.attention``.

- ``full``: every (earlier, in the decoder) position (Vaswani et al. 2017): O(n^2).
- ``local``: the ``window`` nearest positions on each side (the decoder: the last ``window``),
  as in Longformer's sliding window (Beltagy et al. 2020): O(n*w).
- ``local_global``: ``local`` plus the first ``global_tokens`` positions, which every query reads
  and which read every position (Longformer's global attention, on fixed positions): O(n*(w+g)).
- ``block_sparse``: blocks of ``block_size`` positions; a query block reads its neighbour
  blocks, the first ``global_blocks`` blocks and ``random_blocks`` other blocks, and the global
  blocks read everything (BigBird, Zaheer et al. 2020): O(n*b*(3+g+r)). Encoder only.
- ``low_rank``: keys and values projected along the sequence to ``rank`` rows by learned
  (rank, max_len) maps per layer, shared by the heads (Linformer, Wang et al. 2020): O(n*k).
  Encoder only: the projection mixes every position, so a decoder query would read the future.

Every variant other than ``full`` computes only the scores it keeps: queries go in blocks, each
block against the keys it reads, gathered (``local`` reads 3 blocks of ``window`` keys, 2 in the
decoder; ``block_sparse`` 3+g+r blocks), and ``low_rank`` attends to ``min(rank, n)`` projected
rows. Each block's attention is the model's own attention kernel (SDPA, through
``nmt.kernels``). A padded query always reads itself, so no row of scores is empty.

Decoding: ``local`` and ``local_global`` keep only the keys a later query can read in the
key/value cache (the first ``global_tokens`` and the last ``window`` + 1), so a step costs and
holds O(w+g), not O(n).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PATTERNS = ("full", "local", "local_global", "block_sparse", "low_rank")
OPTIONS = {  # the options each pattern takes (the others must stay null)
    "full": (),
    "local": ("window",),
    "local_global": ("window", "global_tokens"),
    "block_sparse": ("block_size", "global_blocks", "random_blocks"),
    "low_rank": ("rank",),
}
ALL_OPTIONS = ("window", "global_tokens", "block_size", "global_blocks", "random_blocks", "rank")
DECODER_REFUSES = {
    "block_sparse": "its random blocks read ahead of a query; use local or local_global in the decoder",
    "low_rank": "its projection mixes every position, so a query would read the future; use local or local_global in the decoder",
}
# attend(q (N, heads, T, d), k, v (N, heads, S, d), mask (N or 1, 1, T or 1, S) | None) -> (N, heads, T, d)
Attend = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]


def make_pattern(part: str, attention: str | None, max_len: int, **options: int | None) -> "Pattern | None":
    """The pattern of ``model.<part>.attention`` with its options (None: full attention, the
    plain path). ``attention=None`` with a ``window``: ``local`` (configs from before the key)."""
    if attention is None:
        attention = "full" if options.get("window") is None else "local_global" if options.get("global_tokens") else "local"
    key = f"model.{part}"
    if attention not in PATTERNS:
        raise ValueError(f"{key}.attention={attention}: unknown pattern; choose one of {', '.join(PATTERNS)}")
    if part == "decoder" and attention in DECODER_REFUSES:
        raise ValueError(f"{key}.attention={attention}: encoder only ({DECODER_REFUSES[attention]})")
    for name, value in options.items():
        if value is not None and name not in OPTIONS[attention]:
            takes = ", ".join(OPTIONS[attention]) or "no options"
            raise ValueError(f"{key}.{name}={value}: the {attention} pattern does not take it (it takes {takes}); "
                             f"set {key}.{name}=null or choose the pattern that uses it")
    for name in OPTIONS[attention]:
        value, least = options.get(name), 0 if name in ("random_blocks", "global_blocks") else 1
        if value is None:
            if name in ("random_blocks", "global_blocks"):
                continue
            raise ValueError(f"{key}.attention={attention} needs {key}.{name}: set it to an integer >= 1")
        if isinstance(value, bool) or not isinstance(value, int) or value < least or value > max_len:
            raise ValueError(f"{key}.{name}={value}: must be an integer from {least} to the model's max_len ({max_len})")
    if attention == "full":
        return None
    if attention == "local":
        return Local(options["window"], 0)
    if attention == "local_global":
        return Local(options["window"], options["global_tokens"])
    if attention == "block_sparse":
        return BlockSparse(options["block_size"], options.get("global_blocks") or 0, options.get("random_blocks") or 0)
    return LowRank(options["rank"], max_len)


def _pad_to_blocks(x: Tensor, block: int) -> Tensor:
    """(N, heads, T, d) -> (N, heads, nb, block, d), zero-padded at the end."""
    pad = -x.size(2) % block
    return F.pad(x, (0, 0, 0, pad)).unflatten(2, (-1, block))


def _blocked(attend: Attend, qb: Tensor, kb: Tensor, vb: Tensor, mask: Tensor) -> Tensor:
    """Each query block against its own gathered keys: qb (N, h, nb, b, d), kb/vb (N, h, nb, m, d),
    mask (N, nb, b, m) -> (N, h, nb*b, d)."""
    n, h, nb, b, d = qb.shape
    flat = lambda x: x.transpose(1, 2).flatten(0, 1)  # noqa: E731  (N*nb, h, ., d)
    out = attend(flat(qb), flat(kb), flat(vb), mask.flatten(0, 1).unsqueeze(1))
    return out.unflatten(0, (n, nb)).transpose(1, 2).flatten(2, 3)


class Pattern(nn.Module, ABC):
    """A self-attention pattern: ``forward`` attends over a whole sequence (training, the encoder,
    a teacher-forced decoder), ``trim`` keeps a decoder's key/value cache to what later queries read."""

    name: str

    @abstractmethod
    def forward(self, attend: Attend, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, causal: bool) -> Tensor:
        """q/k/v (N, heads, T, d), ``key_mask`` (N, T) True on real positions (None: all real)."""

    def trim(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v

    def extra_repr(self) -> str:
        return ", ".join(f"{key}={getattr(self, key)}" for key in OPTIONS[self.name])


class Local(Pattern):
    """Sliding window of ``window`` positions on each side (causal: the last ``window`` and
    itself), plus the first ``global_tokens`` positions read by and reading every query."""

    def __init__(self, window: int, global_tokens: int = 0) -> None:
        super().__init__()
        self.window, self.global_tokens = window, global_tokens
        self.name = "local_global" if global_tokens else "local"

    def near(self, i: Tensor, j: Tensor, causal: bool) -> Tensor:
        """Whether key position j is in query position i's window (broadcast)."""
        return (i - j).abs() <= self.window if not causal else (j <= i) & (i - j <= self.window)

    def allowed(self, i: Tensor, j: Tensor, causal: bool) -> Tensor:
        """Whether query position i reads key position j (broadcast): the definition the blocked
        ``forward`` computes."""
        near = self.near(i, j, causal)
        if not self.global_tokens:
            return near
        g = self.global_tokens
        return near | ((j < g) & (j <= i if causal else True)) | ((i < g) & (True if not causal else j <= i))

    def forward(self, attend: Attend, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, causal: bool) -> Tensor:
        n, h, t, d = q.shape
        b = min(self.window, t)  # block size: a block's window spans its neighbour blocks
        valid = key_mask if key_mask is not None else q.new_ones(n, t, dtype=torch.bool)
        qb, kb, vb = (_pad_to_blocks(x, b) for x in (q, k, v))
        nb = qb.size(2)
        validb = F.pad(valid, (0, nb * b - t)).view(n, nb, b)
        sides = (1, 0) if causal else (1, 1)  # neighbour blocks before and after

        def neighbours(x: Tensor, dim: int) -> Tensor:  # (.., nb, b, ..) -> (.., nb, (1+before+after)*b, ..)
            pad = [0, 0] * (x.dim() - dim - 1) + list(sides)
            padded = F.pad(x, pad)
            parts = [padded.narrow(dim, s, nb) for s in range(sum(sides) + 1)]
            return torch.cat(parts, dim=dim + 1)

        kw, vw, valid_w = neighbours(kb, 2), neighbours(vb, 2), neighbours(validb, 1)  # (N, h, nb, m, d), (N, nb, m)
        m = kw.size(3)
        blocks = torch.arange(nb, device=q.device)
        i = (blocks[:, None] * b + torch.arange(b, device=q.device)[None, :])[:, :, None]  # (nb, b, 1)
        j = (blocks[:, None] - sides[0]) * b + torch.arange(m, device=q.device)[None, :]  # (nb, m)
        j = j[:, None, :]
        mask = self.near(i, j, causal)[None] & (valid_w[:, :, None, :] | (i == j)[None])  # (N, nb, b, m)
        g = min(self.global_tokens, t)
        if g:  # the global keys, for every block, where the window does not already hold them
            jg = torch.arange(g, device=q.device)
            kw = torch.cat([kw, k[:, :, None, :g].expand(n, h, nb, g, d)], dim=3)
            vw = torch.cat([vw, v[:, :, None, :g].expand(n, h, nb, g, d)], dim=3)
            far = ~self.near(i, jg, causal) & ((jg <= i) if causal else True)  # not already in the window
            mask = torch.cat([mask, far[None] & valid[:, None, None, :g]], dim=3)
        out = _blocked(attend, qb, kw, vw, mask)[:, :, :t]
        if g and not causal:  # the global queries read every position (causal: their window and globals hold them)
            out = torch.cat([attend(q[:, :, :g], k, v, valid[:, None, None, :]), out[:, :, g:]], dim=2)
        return out

    def trim(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keep the first ``global_tokens`` and the last ``window`` + 1 positions of a cache."""
        keep = self.global_tokens + self.window + 1
        if k.size(2) <= keep:
            return k, v
        g, w = self.global_tokens, self.window + 1
        return (torch.cat([k[:, :, :g], k[:, :, -w:]], dim=2), torch.cat([v[:, :, :g], v[:, :, -w:]], dim=2))


class BlockSparse(Pattern):
    """BigBird's pattern on blocks of ``block_size``: neighbours, ``global_blocks`` first blocks
    and ``random_blocks`` others per query block (drawn once per number of blocks, seeded, so
    every step, rank and recomputation sees the same pattern). Encoder only."""

    name = "block_sparse"

    def __init__(self, block_size: int, global_blocks: int = 0, random_blocks: int = 0, seed: int = 0) -> None:
        super().__init__()
        self.block_size, self.global_blocks, self.random_blocks, self.seed = block_size, global_blocks, random_blocks, seed
        self._tables: dict[int, tuple[Tensor, Tensor]] = {}
        self._by_count: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}

    def table(self, nb: int) -> tuple[Tensor, Tensor]:
        """(nb, m) key blocks per query block and whether each slot is used (no block twice)."""
        if nb not in self._tables:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + nb)
            rows = []
            for qb in range(nb):
                chosen = [x for x in (qb - 1, qb, qb + 1) if 0 <= x < nb]
                chosen += [x for x in range(min(self.global_blocks, nb)) if x not in chosen]
                rest = torch.tensor([x for x in range(nb) if x not in chosen], dtype=torch.long)
                if len(rest) and self.random_blocks:
                    chosen += rest[torch.randperm(len(rest), generator=generator)[: self.random_blocks]].tolist()
                rows.append(chosen)
            m = max(len(r) for r in rows)
            idx = torch.tensor([r + [0] * (m - len(r)) for r in rows], dtype=torch.long)
            used = torch.tensor([[True] * len(r) + [False] * (m - len(r)) for r in rows])
            self._tables[nb] = (idx, used)
        return self._tables[nb]

    def tables(self, blocks: Tensor, nb: int) -> tuple[Tensor, Tensor]:
        """Per sentence, from its own number of blocks (``blocks`` (N,), on the model's device), so
        that batching and padding change nothing: (N, nb, m) key blocks per query block and which
        slots are used; a padding query block reads itself. Indexing a table of every count from 1
        to nb (built once per nb and device) needs no host sync."""
        key = (nb, str(blocks.device))
        if key not in self._by_count:
            own = [self.table(c) for c in range(1, nb + 1)]
            m = max(idx.size(1) for idx, _ in own)
            idx = torch.arange(nb).view(1, nb, 1).repeat(nb + 1, 1, m)
            used = torch.zeros(nb + 1, nb, m, dtype=torch.bool)
            used[:, :, 0] = True
            for c, (idx_c, used_c) in enumerate(own, start=1):
                idx[c, :c, : idx_c.size(1)] = idx_c
                used[c, :c] = F.pad(used_c, (0, m - used_c.size(1)))
            self._by_count[key] = (idx.to(blocks.device), used.to(blocks.device))
        idx, used = self._by_count[key]
        return idx[blocks], used[blocks]

    def forward(self, attend: Attend, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, causal: bool) -> Tensor:
        if causal:
            raise ValueError("block_sparse attention is encoder only")
        n, h, t, d = q.shape
        b = self.block_size
        valid = key_mask if key_mask is not None else q.new_ones(n, t, dtype=torch.bool)
        qb, kb, vb = (_pad_to_blocks(x, b) for x in (q, k, v))
        nb = qb.size(2)
        blocks = (valid.sum(1).clamp(min=1) + b - 1) // b
        idx, used = self.tables(blocks, nb)  # (N, nb, m)
        rows = torch.arange(n, device=q.device)[:, None, None]
        gather = lambda x: x.transpose(1, 2)[rows, idx].permute(0, 3, 1, 2, 4, 5).flatten(3, 4)  # noqa: E731  (N, h, nb, m*b, d)
        kw, vw = gather(kb), gather(vb)
        validb = F.pad(valid, (0, nb * b - t)).view(n, nb, b)
        slots = used.repeat_interleave(b, 2)  # (N, nb, m*b)
        key_ok = validb[rows, idx].flatten(2, 3) & slots
        i = torch.arange(nb * b, device=q.device).view(1, nb, b, 1)
        j = (idx[..., None] * b + torch.arange(b, device=q.device)).flatten(2, 3)[:, :, None, :]  # (N, nb, 1, m*b)
        mask = key_ok[:, :, None, :] | ((i == j) & slots[:, :, None, :])
        out = _blocked(attend, qb, kw, vw, mask)[:, :, :t]
        g = min(self.global_blocks * b, t)
        if g:  # the global blocks read every position
            out = torch.cat([attend(q[:, :, :g], k, v, valid[:, None, None, :]), out[:, :, g:]], dim=2)
        return out


class LowRank(Pattern):
    """Linformer: keys and values projected along the sequence by E and F (rank, max_len), the
    heads sharing them. A sentence of length L reads min(rank, L) projected rows, built from its
    own positions only, so its output does not depend on the batch's padding."""

    name = "low_rank"

    def __init__(self, rank: int, max_len: int) -> None:
        super().__init__()
        self.rank = rank
        self.e = nn.Parameter(torch.randn(rank, max_len) / math.sqrt(rank))
        self.f = nn.Parameter(torch.randn(rank, max_len) / math.sqrt(rank))

    def forward(self, attend: Attend, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, causal: bool) -> Tensor:
        if causal:
            raise ValueError("low_rank attention is encoder only")
        n, h, t, d = q.shape
        valid = key_mask if key_mask is not None else q.new_ones(n, t, dtype=torch.bool)
        r = min(self.rank, t)
        keep = valid[:, None, :, None].to(k.dtype)
        e, f = self.e[:r, :t].to(k.dtype), self.f[:r, :t].to(v.dtype)
        kp, vp = e @ (k * keep), f @ (v * keep)  # (N, h, r, d)
        lengths = valid.sum(1)
        rows = torch.arange(r, device=q.device)[None, :] < lengths.clamp(min=1)[:, None]  # (N, r)
        return attend(q, kp, vp, rows[:, None, None, :])

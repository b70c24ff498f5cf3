"""Transformer encoder and decoder (Vaswani et al. 2017) on ``scaled_dot_product_attention``.

Options: ``norm: pre | post`` (Xiong et al. 2020 / the original; pre-norm ends each stack with a
layer norm), ``positions: sinusoidal | learned | rope | fairseq`` (rope: Su et al. 2021, applied to
self-attention queries and keys; fairseq: the sinusoids of imported M2M100/NLLB-200 models,
``fairseq_sinusoids``),
``position_shift`` (SHAPE, Kiyono et al. 2021: in training, a sentence pair's absolute positions
start at a random 0..K on both sides, drawn by the encoder and passed to a Transformer decoder in
the memory; an LSTM decoder ignores it, and a Transformer decoder after an LSTM encoder is not
shifted; rotary positions, relative already, are never shifted; decoding starts at 0), ``attention``:
the self-attention pattern (``full``, ``local``, ``local_global``, ``block_sparse``, ``low_rank``;
``nmt.models.attention_patterns``) with its options, ``attention_dropout`` and ``activation_dropout`` apart from the residual
``dropout`` (0 by default: attention dropout would move SDPA off its fused kernels), and
gradient checkpointing per layer. The decoder decodes incrementally: its
``state`` keeps each layer's self-attention keys/values, and the cross-attention keys/values are
projected once per sentence in ``prepare_memory``. SDPA returns no weights, so attention plots
take an eager path (``need_attn``). ``activation`` is the feed-forward non-linearity (``relu``,
``gelu``, ``swish``) and ``logits_bias`` gives the decoder's output layer a bias (both as Marian's
models have them, ``nmt.checkpoints.marian``); ``embedding_norm`` puts a layer norm after the
embeddings and positions (mBART's ``layernorm_embedding``, ``nmt.checkpoints.m2m100``);
``start_from_eos`` makes the decoder start as fairseq's does (M2M100, NLLB-200, mBART-50): BOS
reads the EOS row of the embedding, and its logit is the constant ``NEVER``, so no weight is read
or trained for it and the model is exactly one whose decoder starts from EOS. Every
attention can mask its heads' outputs (``head_mask``) or drop heads from its weights
(``keep_heads``): a pruned encoder or decoder has its heads per layer (``self_heads``,
``cross_heads``; ``nmt.models.head_mask``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from nmt.kernels import UsesKernels
from nmt.models.attention import grouped
from nmt.models.attention_patterns import ALL_OPTIONS, Pattern, make_pattern
from nmt.models.dropout import Dropout
from nmt.specials import BOS, EOS, NEVER, PAD

POSITIONS = ("sinusoidal", "learned", "rope", "fairseq")
FAIRSEQ_OFFSET = 2  # fairseq's first position: its padding id (1) + 1
INITS = ("xavier", "xavier_small_output", "torch")
# The feed-forward activation: ReLU (Vaswani et al. 2017), GELU (Hendrycks & Gimpel 2016, the
# exact erf form) or swish/SiLU (Ramachandran et al. 2017; Marian's OPUS-MT models).
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "swish": nn.SiLU}


def sinusoids(length: int, size: int) -> Tensor:
    """Sinusoidal position table (length, size), Vaswani et al. 2017 sec. 3.5."""
    pos = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, size, 2, dtype=torch.float32) * (-math.log(10000.0) / size))
    table = torch.zeros(length, size)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


def fairseq_sinusoids(length: int, size: int) -> Tensor:
    """fairseq's sinusoidal table (M2M100 and NLLB-200, Fan et al. 2021; Costa-jussa et al. 2022),
    (length, size) for positions ``FAIRSEQ_OFFSET`` onwards: the sines in the first half of the
    units, the cosines in the second, frequencies 10000 ** (-i / (size / 2 - 1))."""
    half = size // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * (-math.log(10000.0) / (half - 1)))
    angles = torch.arange(FAIRSEQ_OFFSET, FAIRSEQ_OFFSET + length, dtype=torch.float32).unsqueeze(1) * freq
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class Rotary(nn.Module):
    """Rotary position embedding on (B, heads, T, d) tensors, starting at position ``offset``."""

    def __init__(self, head_size: int, max_len: int) -> None:
        super().__init__()
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (T, d/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """``offset``: the first position, or each row's one position (B,) (a one-step ``x``)."""
        if isinstance(offset, Tensor):
            cos = self.cos.index_select(0, offset)[:, None, None].to(x.dtype)  # (B, 1, 1, d/2)
            sin = self.sin.index_select(0, offset)[:, None, None].to(x.dtype)
        else:
            cos = self.cos[offset : offset + x.size(-2)].to(x.dtype)
            sin = self.sin[offset : offset + x.size(-2)].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class MultiHeadAttention(UsesKernels, nn.Module):
    """Multi-head attention; ``mask`` is a bool (B or 1, 1, T or 1, S) tensor, True = attend.

    ``head_size`` (default ``hidden_size / num_heads``) lets a pruned layer keep fewer heads of
    the same size (``keep_heads``). ``head_mask`` (heads,), when set, multiplies each head's output
    before the output projection: the mask variable of Michel et al. (2019), 1 keeps a head and 0
    removes it (``nmt.models.head_mask``)."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float, kv_size: int | None = None,
                 head_size: int | None = None) -> None:
        super().__init__()
        if head_size is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
            head_size = hidden_size // num_heads
        self.num_heads = num_heads
        self.head_size = head_size
        self.dropout = dropout
        inner = num_heads * head_size
        self.q_proj = nn.Linear(hidden_size, inner)
        self.kv_proj = nn.Linear(kv_size or hidden_size, 2 * inner)
        self.out_proj = nn.Linear(inner, hidden_size)
        self.pattern: Pattern | None = None  # self-attention only: which keys a query reads (None: all)
        self.register_buffer("head_mask", None, persistent=False)  # (heads,) or None: every head whole

    def split(self, x: Tensor) -> Tensor:  # (B, T, heads * d) -> (B, heads, T, d)
        return x.view(x.size(0), x.size(1), self.num_heads, -1).transpose(1, 2)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.kv_proj(x).chunk(2, dim=-1)
        return self.split(k), self.split(v)

    def merge(self, out: Tensor) -> Tensor:
        """The heads' outputs (B, heads, T, d), each times its ``head_mask`` entry, concatenated
        and projected: (B, T, H)."""
        if self.head_mask is not None:
            out = out * self.head_mask.to(out.dtype)[:, None, None]
        return self.out_proj(out.transpose(1, 2).reshape(out.size(0), out.size(2), -1))

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """q (B, heads, T, d), k/v (B, heads, S, d) -> output (B, T, H), weights (B, heads, T, S) | None.

        q may have g times the rows of k/v (cross-attention in beam search, which keeps one copy
        of a sentence's keys/values for its g beams; ``nmt.models.attention.grouped``)."""
        is_grouped = q.size(0) != k.size(0)
        if is_grouped and is_causal:
            raise ValueError(f"grouped queries take no causal mask: {q.size(0)} query rows for {k.size(0)} key rows")
        ops = self.kernels.ops(q)
        dropout = self.dropout if self.training else 0.0
        out, weights = grouped(lambda q: ops.attention(q, k, v, mask, dropout, is_causal, need_weights, is_grouped), q, k.size(0))
        return self.merge(out), weights

    def patterned(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, causal: bool) -> Tensor:
        """Self-attention through ``self.pattern``: q/k/v (B, heads, T, d), ``key_mask`` (B, T) -> (B, T, H)."""
        ops = self.kernels.ops(q)
        dropout = self.dropout if self.training else 0.0
        out = self.pattern(lambda q, k, v, mask: ops.attention(q, k, v, mask, dropout, False, False, False)[0],
                           q, k, v, key_mask, causal)
        return self.merge(out)

    def keep_heads(self, heads: list[int]) -> None:
        """Keep only ``heads`` (their indices, in order): their rows of the query, key and value
        projections and their columns of the output projection (Michel et al. 2019's pruning, made
        physical); the others' output is gone, as a ``head_mask`` of 0 removes it."""
        if not heads or sorted(set(heads)) != list(heads) or not 0 <= heads[0] <= heads[-1] < self.num_heads:
            raise ValueError(f"heads to keep: {heads} is not an increasing list of heads from 0 to {self.num_heads - 1}")
        rows = torch.cat([torch.arange(h * self.head_size, (h + 1) * self.head_size) for h in heads])
        kv_rows = torch.cat([rows, rows + self.num_heads * self.head_size])  # kv_proj's rows: keys, then values
        for name, index, dim in (("q_proj", rows, 0), ("kv_proj", kv_rows, 0), ("out_proj", rows, 1)):
            old = getattr(self, name)
            index = index.to(old.weight.device)
            weight = old.weight.detach().index_select(dim, index)
            new = nn.Linear(weight.size(1), weight.size(0), device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                new.weight.copy_(weight)
                new.bias.copy_(old.bias if dim == 1 else old.bias.index_select(0, index))
            setattr(self, name, new)
        if self.head_mask is not None:
            self.head_mask = self.head_mask[torch.tensor(heads, device=self.head_mask.device)]
        self.num_heads = len(heads)


class FeedForward(nn.Sequential):
    def __init__(self, hidden_size: int, ff_size: int, dropout: float, activation: str = "relu") -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
        super().__init__(nn.Linear(hidden_size, ff_size), ACTIVATIONS[activation](), Dropout(dropout),
                         nn.Linear(ff_size, hidden_size))


def init_weights(layers: nn.Module, init: str) -> None:
    """``xavier``: Glorot-uniform weights and zero biases for the attention and feed-forward maps
    in ``layers``, the key and value maps each on its own (as tensor2tensor and fairseq initialise
    the Transformer); ``xavier_small_output``: the same, but each attention's output projection
    uniform in [-0.02, 0.02] (the advice of attention tutorials: Xavier for the query, key and
    value maps, a small range for the output map); ``torch``: ``nn.Linear``'s own initialisation."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if init == "torch":
        return
    with torch.no_grad():
        for module in layers.modules():
            if isinstance(module, MultiHeadAttention):
                linears = [module.q_proj, module.kv_proj, module.out_proj]
                weights = [module.q_proj.weight, *module.kv_proj.weight.chunk(2), module.out_proj.weight]
            elif isinstance(module, FeedForward):
                linears = [module[0], module[3]]
                weights = [linear.weight for linear in linears]
            else:
                continue
            for weight in weights:
                nn.init.xavier_uniform_(weight)
            for linear in linears:
                linear.bias.zero_()
            if init == "xavier_small_output" and isinstance(module, MultiHeadAttention):
                nn.init.uniform_(module.out_proj.weight, -0.02, 0.02)


class _Block(nn.Module):
    """Residual sublayer wiring shared by encoder and decoder layers (pre- or post-norm)."""

    def __init__(self, hidden_size: int, dropout: float, norm: str, num_sublayers: int) -> None:
        super().__init__()
        if norm not in ("pre", "post"):
            raise ValueError(f"norm must be 'pre' or 'post', got {norm!r}")
        self.pre_norm = norm == "pre"
        self.norms = nn.ModuleList(nn.LayerNorm(hidden_size) for _ in range(num_sublayers))
        self.drop = Dropout(dropout)

    def residual(self, i: int, x: Tensor, fn) -> Tensor:
        if self.pre_norm:
            return x + self.drop(fn(self.norms[i](x)))
        return self.norms[i](x + self.drop(fn(x)))


class EncoderLayer(_Block):
    def __init__(self, hidden_size: int, num_heads: int, ff_size: int, dropout: float, norm: str, rotary: Rotary | None,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0, activation: str = "relu",
                 head_size: int | None = None):
        super().__init__(hidden_size, dropout, norm, 2)
        self.self_attn = MultiHeadAttention(hidden_size, num_heads, attention_dropout, head_size=head_size)
        self.ff = FeedForward(hidden_size, ff_size, activation_dropout, activation)
        self.rotary = rotary

    def _attend(self, x: Tensor, mask: Tensor, weights: list | None) -> Tensor:
        q, (k, v) = self.self_attn.split(self.self_attn.q_proj(x)), self.self_attn.project_kv(x)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        if self.self_attn.pattern is not None:
            if weights is not None:
                raise ValueError(f"self-attention weights of the {self.self_attn.pattern.name} pattern are not computed: "
                                 "full attention only")
            return self.self_attn.patterned(q, k, v, mask[:, 0, 0], causal=False)
        out, w = self.self_attn(q, k, v, mask, need_weights=weights is not None)
        if weights is not None:
            weights.append(w)
        return out

    def forward(self, x: Tensor, mask: Tensor, weights: list | None = None) -> Tensor:
        """``weights``: a list that gets this layer's self-attention weights (B, heads, S, S)."""
        x = self.residual(0, x, lambda y: self._attend(y, mask, weights))
        return self.residual(1, x, self.ff)


class DecoderLayer(_Block):
    def __init__(
        self, hidden_size: int, num_heads: int, ff_size: int, dropout: float, norm: str, rotary: Rotary | None, memory_size: int,
        attention_dropout: float = 0.0, activation_dropout: float = 0.0, activation: str = "relu",
        head_size: int | None = None, cross_heads: int | None = None,
    ):
        super().__init__(hidden_size, dropout, norm, 3)
        self.self_attn = MultiHeadAttention(hidden_size, num_heads, attention_dropout, head_size=head_size)
        self.cross_attn = MultiHeadAttention(hidden_size, cross_heads or num_heads, attention_dropout, kv_size=memory_size,
                                             head_size=head_size)
        self.ff = FeedForward(hidden_size, ff_size, activation_dropout, activation)
        self.rotary = rotary

    def _self(self, x: Tensor, cache: dict | None, offset: int | Tensor, weights: list | None = None) -> Tensor:
        q, (k, v) = self.self_attn.split(self.self_attn.q_proj(x)), self.self_attn.project_kv(x)
        if self.rotary is not None:
            q, k = self.rotary(q, offset), self.rotary(k, offset)
        pattern = self.self_attn.pattern
        if isinstance(offset, Tensor):  # a preallocated cache: write this step's key/value at its position
            cache["k"].index_copy_(2, offset[:1], k)  # every row is at the same step
            cache["v"].index_copy_(2, offset[:1], v)
            keys = torch.arange(cache["k"].size(2), device=offset.device)[None, :]
            reads = keys <= offset[:, None]  # (B, capacity): the positions written so far
            if pattern is not None:
                reads = reads & pattern.allowed(offset[:, None], keys, causal=True)
            return self.self_attn(q, cache["k"], cache["v"], reads[:, None, None, :])[0]
        if cache is not None:  # incremental: append this step's key/value to the cache
            k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            if pattern is not None:  # keep what later queries read
                k, v = pattern.trim(k, v)
            cache["k"], cache["v"] = k, v
            return self.self_attn(q, k, v)[0]  # one query: every cached key is one it reads
        if pattern is not None:
            if weights is not None:
                raise ValueError(f"self-attention weights of the {pattern.name} pattern are not computed: full attention only")
            return self.self_attn.patterned(q, k, v, None, causal=True)
        out, w = self.self_attn(q, k, v, is_causal=True, need_weights=weights is not None)
        if weights is not None:
            weights.append(w)
        return out

    def forward(
        self,
        x: Tensor,
        cross_kv: tuple[Tensor, Tensor],
        src_mask: Tensor,
        cache: dict | None = None,
        offset: int | Tensor = 0,
        need_weights: bool = False,
        self_weights: list | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The layer over x and its cross-attention weights (B, heads, T, S) with ``need_weights``;
        ``self_weights``: a list that gets the teacher-forced self-attention weights (B, heads, T, T)."""
        x = self.residual(0, x, lambda y: self._self(y, cache, offset, self_weights))
        weights = []

        def cross(y: Tensor) -> Tensor:
            out, w = self.cross_attn(self.cross_attn.split(self.cross_attn.q_proj(y)), *cross_kv, src_mask, need_weights=need_weights)
            weights.append(w)
            return out

        x = self.residual(1, x, cross)
        return self.residual(2, x, self.ff), weights[0]


class _Embedding(nn.Module):
    """Token embedding scaled by sqrt(H), plus absolute positions unless they are rotary, then
    (``norm``) a layer norm, as mBART's ``layernorm_embedding``; ``start_from_eos``: BOS reads the
    EOS row (fairseq's decoders start from ``</s>``)."""

    def __init__(self, vocab_size: int, hidden_size: int, dropout: float, positions: str, max_len: int,
                 norm: bool = False, start_from_eos: bool = False):
        super().__init__()
        self.start_from_eos = start_from_eos
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        self.embed = nn.Embedding(vocab_size, hidden_size, padding_idx=PAD)
        # N(0, 1/H): after the sqrt(H) scale inputs have unit variance, and tied output logits
        # start small (as in fairseq's Transformer).
        nn.init.normal_(self.embed.weight, std=hidden_size**-0.5)
        with torch.no_grad():
            self.embed.weight[PAD].zero_()
        self.scale = math.sqrt(hidden_size)
        self.positions = positions
        self.max_len = max_len
        if positions == "learned":
            self.pos = nn.Embedding(max_len, hidden_size)
        elif positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoids(max_len, hidden_size), persistent=False)
        elif positions == "fairseq":
            self.register_buffer("pos_table", fairseq_sinusoids(max_len, hidden_size), persistent=False)
        self.drop = Dropout(dropout)
        self.norm = nn.LayerNorm(hidden_size) if norm else None

    def _out(self, x: Tensor) -> Tensor:
        return self.drop(x if self.norm is None else self.norm(x))

    def forward(self, tokens: Tensor, offset: int | Tensor = 0, shift: tuple[Tensor, int] | None = None) -> Tensor:
        """Positions start at ``offset`` (a decoding step; a tensor (B,): each row's position, for
        one-token rows, checked against ``max_len`` by whoever made it), or per sentence at
        ``shift``: the starts (B,) and their bound (training with ``position_shift``)."""
        if self.start_from_eos:
            tokens = tokens.masked_fill(tokens == BOS, EOS)
        if isinstance(offset, Tensor):
            x = self.embed(tokens) * self.scale
            if self.positions == "rope":
                return self._out(x)
            table = self.pos.weight if self.positions == "learned" else self.pos_table
            return self._out(x + table.index_select(0, offset).unsqueeze(1).to(x.dtype))
        if offset + tokens.size(1) > self.max_len:
            raise ValueError(f"sequence of {offset + tokens.size(1)} tokens exceeds the model's max_len {self.max_len}")
        if shift is not None and tokens.size(1) + shift[1] > self.max_len:
            raise ValueError(
                f"sequence of {tokens.size(1)} tokens with position_shift {shift[1]} exceeds the "
                f"model's max_len {self.max_len}: lower position_shift or raise max_len"
            )
        x = self.embed(tokens) * self.scale  # (B, T, H)
        if self.positions == "rope":
            return self._out(x)
        table = self.pos.weight if self.positions == "learned" else self.pos_table
        if shift is None:
            pos = table[offset : offset + tokens.size(1)]  # (T, H)
        else:
            pos = table[shift[0].unsqueeze(1) + torch.arange(tokens.size(1), device=tokens.device)]  # (B, T, H)
        return self._out(x + pos.to(x.dtype))


def _patterns(part: str, layers: nn.ModuleList, attention: str | None, max_len: int, options: dict) -> str:
    """Give each layer's self-attention its pattern (one per layer: ``low_rank`` has weights); the
    pattern's name."""
    for layer in layers:
        layer.self_attn.pattern = pattern = make_pattern(part, attention, max_len, **options)
    return "full" if pattern is None else pattern.name


def check_sizes(hidden_size: int, num_layers: int, num_heads: int, ff_size: int, max_len: int, positions: str) -> None:
    """A one-line ValueError naming the argument (the config key of the encoder or decoder) whose
    value cannot build a Transformer: a count below 1, a hidden size the heads do not divide, or an
    odd size that sinusoidal or rotary positions cannot take."""
    for key, value in (("num_layers", num_layers), ("num_heads", num_heads), ("hidden_size", hidden_size),
                       ("ff_size", ff_size), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r}: must be a whole number of at least 1")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size}: must be a multiple of num_heads ({num_heads})")
    size, what = (hidden_size // num_heads, "a head's size (hidden_size / num_heads)") if positions == "rope" else (
        hidden_size, "hidden_size")
    if positions in ("sinusoidal", "rope", "fairseq") and size % 2:
        raise ValueError(f"hidden_size={hidden_size}: {positions} positions need an even {what}")
    if positions == "fairseq" and hidden_size < 4:
        raise ValueError(f"hidden_size={hidden_size}: fairseq positions need at least 4 units")


def layer_heads(key: str, heads: Any, num_layers: int, num_heads: int) -> list[int]:
    """Each layer's head count: ``heads`` (a pruned model's, one per layer, each 1..num_heads) or
    ``num_heads`` everywhere (None); a one-line ValueError naming ``key`` otherwise."""
    if heads is None:
        return [num_heads] * num_layers
    heads = list(heads)
    if len(heads) != num_layers or not all(isinstance(h, int) and not isinstance(h, bool) and 1 <= h <= num_heads
                                           for h in heads):
        raise ValueError(f"{key}={heads}: one head count per layer ({num_layers}), each from 1 to num_heads ({num_heads})")
    return heads


class TransformerEncoder(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int = 256,
        num_layers: int = 3,
        num_heads: int = 4,
        ff_size: int = 1024,
        dropout: float = 0.1,
        norm: str = "pre",
        positions: str = "sinusoidal",
        max_len: int = 1024,
        attention: str | None = None,
        window: int | None = None,
        global_tokens: int | None = None,
        block_size: int | None = None,
        global_blocks: int | None = None,
        random_blocks: int | None = None,
        rank: int | None = None,
        attention_dropout: float = 0.0,
        activation_dropout: float = 0.0,
        position_shift: int = 0,
        init: str = "xavier",
        activation: str = "relu",
        embedding_norm: bool = False,
        self_heads: list[int] | None = None,
    ) -> None:
        super().__init__()
        check_sizes(hidden_size, num_layers, num_heads, ff_size, max_len, positions)
        heads = layer_heads("self_heads", self_heads, num_layers, num_heads)
        if position_shift < 0:
            raise ValueError(f"position_shift must be >= 0, got {position_shift}")
        rotary = Rotary(hidden_size // num_heads, max_len) if positions == "rope" else None
        self.embed_tokens = _Embedding(vocab_size, hidden_size, dropout, positions, max_len, embedding_norm)
        self.embed = self.embed_tokens.embed  # for embedding tying
        self.position_shift = 0 if positions == "rope" else position_shift  # rotary positions are relative already
        self.layers = nn.ModuleList(
            EncoderLayer(hidden_size, h, ff_size, dropout, norm, rotary, attention_dropout, activation_dropout,
                         activation, hidden_size // num_heads)
            for h in heads
        )
        init_weights(self.layers, init)
        self.final_norm = nn.LayerNorm(hidden_size) if norm == "pre" else nn.Identity()
        options = dict(zip(ALL_OPTIONS, (window, global_tokens, block_size, global_blocks, random_blocks, rank)))
        self.attention = _patterns("encoder", self.layers, attention, max_len, options)
        self.gradient_checkpointing = False

    @property
    def max_positions(self) -> int:
        """The most source tokens the position table (or the rotary angles) covers."""
        return self.embed_tokens.max_len

    def self_attention(self, src: Tensor, src_mask: Tensor) -> list[Tensor]:
        """Each layer's self-attention weights (B, heads, S, S), in eval mode (a pruned layer has
        fewer heads)."""
        x, mask, weights = self.embed_tokens(src), src_mask[:, None, None, :], []
        for layer in self.layers:
            x = layer(x, mask, weights)
        return weights

    def forward(self, src: Tensor, src_mask: Tensor) -> dict[str, Tensor]:
        shift = None
        if self.training and self.position_shift:  # SHAPE: one random start per sentence pair
            shift = (torch.randint(0, self.position_shift + 1, (src.size(0),), device=src.device), self.position_shift)
        x = self.embed_tokens(src, shift=shift)  # (B, S, H)
        mask = src_mask[:, None, None, :]  # (B, 1, 1, S)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(layer, x, mask, use_reentrant=False)
            else:
                x = layer(x, mask)
        memory = {"enc_out": self.final_norm(x), "src_mask": src_mask}
        if shift is not None:  # the decoder's teacher-forced positions start there too
            memory["position_shift"] = shift
        return memory


class TransformerDecoder(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int = 256,
        num_layers: int = 3,
        num_heads: int = 4,
        ff_size: int = 1024,
        dropout: float = 0.1,
        norm: str = "pre",
        positions: str = "sinusoidal",
        max_len: int = 1024,
        attention: str | None = None,
        window: int | None = None,
        global_tokens: int | None = None,
        memory_size: int | None = None,
        attention_dropout: float = 0.0,
        activation_dropout: float = 0.0,
        init: str = "xavier",
        activation: str = "relu",
        logits_bias: bool = False,
        embedding_norm: bool = False,
        self_heads: list[int] | None = None,
        cross_heads: list[int] | None = None,
        start_from_eos: bool = False,
    ) -> None:
        super().__init__()
        check_sizes(hidden_size, num_layers, num_heads, ff_size, max_len, positions)
        heads = zip(layer_heads("self_heads", self_heads, num_layers, num_heads),
                    layer_heads("cross_heads", cross_heads, num_layers, num_heads))
        rotary = Rotary(hidden_size // num_heads, max_len) if positions == "rope" else None
        self.embed_tokens = _Embedding(vocab_size, hidden_size, dropout, positions, max_len, embedding_norm,
                                       start_from_eos)
        self.embed = self.embed_tokens.embed
        self.layers = nn.ModuleList(
            DecoderLayer(hidden_size, h, ff_size, dropout, norm, rotary, memory_size or hidden_size,
                         attention_dropout, activation_dropout, activation, hidden_size // num_heads, cross)
            for h, cross in heads
        )
        init_weights(self.layers, init)
        self.final_norm = nn.LayerNorm(hidden_size) if norm == "pre" else nn.Identity()
        self.out = nn.Linear(hidden_size, vocab_size, bias=logits_bias)
        if logits_bias:  # a bias per output piece (Marian's output layer has one), starting at zero
            nn.init.zeros_(self.out.bias)
        self.start_from_eos = start_from_eos  # BOS is never an output: its logit is NEVER, read from no weight
        self.register_buffer("fixed_logits", torch.arange(vocab_size) == BOS if start_from_eos else None,
                             persistent=False)  # (V,) True where the logit is NEVER, or None
        self.num_heads = num_heads
        self.attention = _patterns("decoder", self.layers, attention, max_len, {"window": window, "global_tokens": global_tokens})
        self.gradient_checkpointing = False

    def prepare_memory(self, memory: dict[str, Tensor]) -> dict[str, Tensor]:
        """Project every layer's cross-attention keys/values once per sentence."""
        cross_kv = [layer.cross_attn.project_kv(memory["enc_out"]) for layer in self.layers]
        return {**memory, "cross_kv": cross_kv}

    def init_state(self, memory: dict[str, Tensor], capacity: int | None = None) -> dict[str, Any]:
        """Each layer's self-attention keys/values, empty and growing a step at a time; or, with a
        ``capacity``, preallocated for that many steps (B, heads, capacity, d), written in place at
        each row's position ``pos`` (a tensor (B,)): a state of one shape at every step, which
        ``nmt.decoding.fixed_beam`` reorders in place and a CUDA graph replays."""
        k = memory["cross_kv"][0][0]
        shapes = [(k.size(0), layer.self_attn.num_heads, capacity or 0, k.size(3)) for layer in self.layers]
        if capacity is None:  # (B, heads, 0, d): a pruned layer keeps fewer heads
            return {"pos": 0, "cache": [{"k": k.new_zeros(shape), "v": k.new_zeros(shape)} for shape in shapes]}
        if not 1 <= capacity <= self.fixed_state_steps:
            raise ValueError(f"a key/value cache of {capacity} steps: the decoder has positions for 1 to "
                             f"{self.fixed_state_steps}")
        return {"pos": torch.zeros(k.size(0), dtype=torch.long, device=k.device),
                "cache": [{"k": k.new_zeros(shape), "v": k.new_zeros(shape)} for shape in shapes]}

    @property
    def fixed_state_steps(self) -> int:
        """The most steps a preallocated state (``init_state(capacity=...)``) holds: the positions."""
        return self.embed_tokens.max_len

    def narrow_state(self, state: dict[str, Any], steps: int) -> dict[str, Any]:
        """A preallocated state with each cache a view of its first ``steps`` positions
        (B, heads, steps, d): a step writes its key/value into the cache through it and attends
        over those positions alone."""
        return {"pos": state["pos"], "cache": [{"k": c["k"][:, :, :steps], "v": c["v"][:, :, :steps]}
                                               for c in state["cache"]]}

    def _layers(self, x: Tensor, memory: dict, state: dict | None, need_weights: bool, weights_of: int | None = None):
        """The layers over x; every layer's cross-attention weights with ``need_weights``, or layer
        ``weights_of``'s alone (its eager path; the other layers keep SDPA)."""
        src_mask = memory["src_mask"][:, None, None, :]
        offset = state["pos"] if state else 0
        weights = []
        for i, layer in enumerate(self.layers):
            cache = state["cache"][i] if state else None
            need = need_weights or i == weights_of
            if self.gradient_checkpointing and self.training and state is None and not need:
                x, w = checkpoint(layer, x, memory["cross_kv"][i], src_mask, use_reentrant=False)
            else:
                x, w = layer(x, memory["cross_kv"][i], src_mask, cache, offset, need)
            weights.append(w)
        return self.final_norm(x), weights

    def features(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> Tensor:
        """Teacher-forced top-layer states (B, T, H), the input of ``self.out``."""
        shift = memory.get("position_shift") if self.training else None
        x = self.embed_tokens(tgt_in, shift=shift)
        x, _ = self._layers(x, memory, None, False)
        return x

    def features_with_attention(self, tgt_in: Tensor, memory: dict[str, Tensor], layer: int) -> tuple[Tensor, Tensor]:
        """``features`` (B, T, H) and the cross-attention weights (B, heads, T, S) of decoder
        ``layer`` (from 0; -1: the last) in the same pass, for guided alignment (Garg et al. 2019)."""
        index = range(len(self.layers))[layer]
        shift = memory.get("position_shift") if self.training else None
        x, weights = self._layers(self.embed_tokens(tgt_in, shift=shift), memory, None, False, index)
        return x, weights[index]

    def logits(self, x: Tensor) -> Tensor:
        """The output layer on states (..., H): logits (..., V), BOS's the constant ``NEVER`` with
        ``start_from_eos``."""
        logits = self.out(x)
        return logits if self.fixed_logits is None else logits.masked_fill(self.fixed_logits, NEVER)

    def forward(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> Tensor:
        return self.logits(self.features(tgt_in, memory))  # (B, T, V)

    def decode_step(
        self, prev: Tensor, memory: dict[str, Tensor], state: dict[str, Any], need_attn: bool = False
    ) -> tuple[Tensor, dict[str, Any], Tensor | None]:
        pos = state["pos"]  # a preallocated cache (``init_state(capacity=...)``) is written in place
        state = {"pos": pos, "cache": [dict(c) for c in state["cache"]]}
        x, weights = self._layers(self.embed_tokens(prev.unsqueeze(1), pos), memory, state, need_attn)
        state["pos"] = pos + 1
        attn = weights[-1].mean(1)[:, 0] if need_attn else None  # last layer, mean over heads: (B, S)
        return self.logits(x[:, 0]), state, attn

    def cross_attention(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> Tensor:
        """(B, layers, heads, T, S); a pruned layer's missing heads are filled with its heads' mean
        (so each layer's mean over heads, what alignments read, is its own)."""
        _, weights = self._layers(self.embed_tokens(tgt_in), memory, None, True)
        most = max(w.size(1) for w in weights)
        weights = [torch.cat([w, w.mean(1, keepdim=True).expand(-1, most - w.size(1), -1, -1)], 1) for w in weights]
        return torch.stack(weights, dim=1)

    def attention_weights(self, tgt_in: Tensor, memory: dict[str, Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """Each layer's teacher-forced self-attention (B, heads, T, T) and cross-attention
        (B, heads, T, S) weights, each layer with its own number of heads."""
        x, src_mask, self_weights, cross_weights = self.embed_tokens(tgt_in), memory["src_mask"][:, None, None, :], [], []
        for layer, kv in zip(self.layers, memory["cross_kv"]):
            x, w = layer(x, kv, src_mask, need_weights=True, self_weights=self_weights)
            cross_weights.append(w)
        return self_weights, cross_weights

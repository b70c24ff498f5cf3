"""What each attention head of a Transformer does, and how much the model needs it.

Per head of each kind (``encoder`` self-attention, ``decoder`` self-attention, ``cross``-attention;
``nmt.models.head_mask``), read from the teacher-forced weights of a test set (the references fed
to the decoder), averaged over the query positions of every sentence (padding left out):

- ``confidence``: the largest weight of a query (Voita et al. 2019's confidence);
- ``entropy``: the entropy of a query's weights, in nats;
- ``previous``, ``same``, ``next``: the weight on the key one position before, at, and one after
  the query's own (self-attention only; a positional head puts most of its weight on one of them;
  the decoder's ``next`` is always 0, its attention being causal);
- ``rare``: the weight on rare pieces: the keys whose piece is among the ``rare_share`` of its
  vocabulary with the lowest SentencePiece scores (``rare_ids``). A unigram model's score is the
  piece's log-probability in its training text; a BPE model's falls with the order of its merges,
  later merges being of rarer pairs. So the scores stand for training counts, which a checkpoint
  does not keep;
- ``aer``: for cross-attention heads with gold word alignments (the synthetic corpus's), the
  alignment error rate (Och & Ney 2003) of the head's hard alignment: each target piece linked to
  the source piece it weighs most, lifted to words as ``nmt.inference.alignments`` does;
- ``importance``: Michel et al. (2019)'s, ``importance``.

``analyse`` computes the table; ``write`` saves it as ``heads.json``, ``heads.md`` and
``heads.png`` (a layer x head grid per kind).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.models.head_mask import KINDS, attentions, ones_mask, set_head_mask
from nmt.specials import PAD

STATS = ("confidence", "entropy", "previous", "same", "next", "rare")
COLUMNS = (*STATS, "aer", "importance")  # every column of the table, and what heads.png may draw
TITLES = {"encoder": "encoder self-attention", "decoder": "decoder self-attention", "cross": "cross-attention"}
Batch = tuple[Tensor, Tensor, Tensor, Tensor]  # src, src_mask, tgt_in, tgt_out


def has_heads(model: nn.Module) -> bool:
    """Whether ``model`` has Transformer attention heads (an RNN or an ensemble has none to read)."""
    try:
        attentions(model)
    except (AttributeError, ValueError):
        return False
    return True


def rare_ids(tokenizer: Any, share: float = 0.25) -> Tensor:
    """A bool vector over ``tokenizer``'s ids, True on its rare pieces: the ``share`` of its
    ordinary pieces (no control, unknown or unused ones) with the lowest scores."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"rare_share={share}: a share of the vocabulary above 0 and at most 1")
    sp = tokenizer.sp
    ordinary = [i for i in range(sp.GetPieceSize()) if not (sp.IsControl(i) or sp.IsUnknown(i) or sp.IsUnused(i))]
    ordinary.sort(key=lambda i: (sp.GetScore(i), -i))
    rare = torch.zeros(sp.GetPieceSize(), dtype=torch.bool)
    rare[ordinary[: max(1, round(share * len(ordinary)))]] = True
    return rare


def head_sums(weights: Tensor, query_mask: Tensor, key_mask: Tensor, rare: Tensor | None, positional: bool) -> dict[str, Tensor]:
    """Each head's sums over the real queries of a batch: weights (B, heads, T, S), query_mask
    (B, T) and key_mask (B, S) True on real positions, rare (B, S) True on rare keys (None: no
    ``rare``); ``positional``: self-attention, whose keys are the queries' positions. Returns
    {stat: (heads,)} and ``queries`` (the count)."""
    real = query_mask[:, None, :, None].float()  # (B, 1, T, 1)
    w = weights.float().masked_fill(~key_mask[:, None, None, :], 0.0) * real  # padded queries weigh nothing
    sums = {"queries": query_mask.sum().float().expand(w.size(1)).clone(),
            "confidence": w.amax(-1).sum((0, 2)),
            "entropy": -(w * w.clamp_min(1e-30).log()).sum((0, 2, 3))}
    if rare is not None:
        sums["rare"] = (w * (rare & key_mask)[:, None, None, :].float()).sum((0, 2, 3))
    if positional:  # diagonal(offset): the weight of query i on key i + offset
        for stat, offset in (("previous", -1), ("same", 0), ("next", 1)):
            sums[stat] = w.diagonal(offset, -2, -1).sum((0, 2))
    return sums


class HeadTable:
    """Sums of ``head_sums`` per kind and layer, added up over batches, then averaged by ``rows``."""

    def __init__(self) -> None:
        self.sums: dict[tuple[str, int], dict[str, Tensor]] = {}
        self.aer: dict[tuple[str, int, int], float] = {}
        self.importance: dict[str, list[Tensor]] = {}

    def add(self, kind: str, layer: int, sums: dict[str, Tensor]) -> None:
        into = self.sums.setdefault((kind, layer), {})
        for stat, value in sums.items():
            into[stat] = into[stat] + value if stat in into else value.clone()

    def rows(self) -> list[dict[str, Any]]:
        """One row per head: kind, layer and head (from 0), each statistic (None where it does not apply)."""
        out = []
        for (kind, layer), sums in self.sums.items():
            count = sums["queries"].clamp_min(1)
            for head in range(count.numel()):
                row: dict[str, Any] = {"kind": kind, "layer": layer, "head": head}
                for stat in STATS:
                    row[stat] = round(float(sums[stat][head] / count[head]), 4) if stat in sums else None
                row["aer"] = self.aer.get((kind, layer, head))
                scores = self.importance.get(kind)
                row["importance"] = round(float(scores[layer][head]), 4) if scores is not None else None
                out.append(row)
        return out


def importance(model: nn.Module, batches: Iterable[Batch], normalise: bool = True) -> dict[str, list[Tensor]]:
    """Michel et al. (2019)'s importance of each head: the mean over ``batches`` of the absolute
    gradient of the loss (the batch's mean token cross-entropy, padding left out) with respect to
    a mask variable of 1 multiplying the head's output. ``normalise``: each layer's scores divided
    by their L2 norm (Michel et al. compare heads across layers this way). In eval mode (no
    dropout); the model's weights get no gradients, and its masks are cleared afterwards."""
    masks = ones_mask(model, requires_grad=True)
    flat = [m for kind in masks for m in masks[kind]]
    totals = [torch.zeros_like(m) for m in flat]
    training, count = model.training, 0
    model.eval()
    set_head_mask(model, masks)
    try:
        for src, src_mask, tgt_in, tgt_out in batches:
            with torch.enable_grad():
                logits = model(src, src_mask, tgt_in)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten(), ignore_index=PAD)
                grads = torch.autograd.grad(loss, flat, allow_unused=True)
            for total, grad in zip(totals, grads):
                if grad is not None:
                    total += grad.abs()
            count += 1
    finally:
        set_head_mask(model, None)
        model.train(training)
    scores = iter(t / max(count, 1) for t in totals)
    out = {kind: [next(scores) for _ in masks[kind]] for kind in masks}
    if normalise:
        out = {kind: [s / s.norm() if s.norm() > 0 else s for s in layers] for kind, layers in out.items()}
    return out


def teacher_forced_batches(translator: Any, sources: Sequence[str], refs: Sequence[str],
                           batch_size: int = 32) -> Iterator[tuple[Batch, list[list[int]], list[list[int]]]]:
    """The pairs as teacher-forced batches on the translator's device: (src, src_mask, tgt_in,
    tgt_out), and the batch's source ids (EOS last) and target ids (no EOS)."""
    from nmt.data.tokenizer import BOS, EOS
    from nmt.inference.translator import encode_sources, pad

    src_ids = encode_sources(list(sources), translator.src_vocab, translator.max_src_len)
    tgt_ids = [ids[:-1] for ids in encode_sources(list(refs), translator.tgt_vocab, translator.max_tgt_len)]
    for start in range(0, len(src_ids), batch_size):
        s_ids, t_ids = src_ids[start : start + batch_size], tgt_ids[start : start + batch_size]
        src, src_mask = pad(s_ids, translator.device)
        tgt_in, _ = pad([[BOS, *t] for t in t_ids], translator.device)
        tgt_out, _ = pad([[*t, EOS] for t in t_ids], translator.device)
        yield (src, src_mask, tgt_in, tgt_out), s_ids, t_ids


def analyse(translator: Any, sources: Sequence[str], refs: Sequence[str], gold: Sequence[set] | None = None,
            rare_share: float = 0.25, batch_size: int = 32, with_importance: bool = True) -> list[dict[str, Any]]:
    """The per-head table (``HeadTable.rows``) of ``translator``'s Transformer on the pairs
    (``gold``: their word alignments, for the cross-attention heads' AER; ``with_importance``:
    Michel et al.'s importance on the same pairs)."""
    from nmt.inference.alignments import aer, parse, pharaoh

    model = translator.model
    kinds = attentions(model)  # a model without heads: a one-line ValueError here
    table = HeadTable()
    rare_src, rare_tgt = (rare_ids(v, rare_share).to(translator.device) for v in (translator.src_vocab, translator.tgt_vocab))
    links: dict[tuple[str, int, int], list] = {}
    for (src, src_mask, tgt_in, _), s_ids, t_ids in teacher_forced_batches(translator, sources, refs, batch_size):
        cross = add_batch(table, model, kinds, src, src_mask, tgt_in, rare_src, rare_tgt)
        for layer, w in enumerate(cross):
            if gold is None:
                continue
            for head in range(w.size(1)):
                links.setdefault(("cross", layer, head), []).extend(
                    parse(pharaoh(translator.src_vocab.pieces(s[:-1]), translator.tgt_vocab.pieces(t),
                                  w[i, head, : len(t), : len(s) - 1].float().tolist()))
                    for i, (s, t) in enumerate(zip(s_ids, t_ids)))
    if gold is not None:
        table.aer = {key: round(100 * aer(found, list(gold)), 2) for key, found in links.items()}
    if with_importance:
        table.importance = importance(model, (b for b, _, _ in teacher_forced_batches(translator, sources, refs, batch_size)))
    return table.rows()


def add_batch(table: HeadTable, model: nn.Module, kinds: dict[str, Any], src: Tensor, src_mask: Tensor, tgt_in: Tensor,
              rare_src: Tensor, rare_tgt: Tensor) -> list[Tensor]:
    """Add one teacher-forced batch's sums to ``table``; returns the cross-attention weights of
    each layer, (B, heads, T, S) (none for a model whose decoder has no heads)."""
    tgt_mask = tgt_in != PAD
    with torch.inference_mode():
        memory = model.encode(src, src_mask)
        encoder = model.encoder.self_attention(src, src_mask) if "encoder" in kinds else []
        decoder, cross = model.decoder.attention_weights(tgt_in, memory) if "cross" in kinds else ([], [])
    for layer, w in enumerate(encoder):
        table.add("encoder", layer, head_sums(w, src_mask, src_mask, rare_src[src], True))
    for layer, w in enumerate(decoder):
        table.add("decoder", layer, head_sums(w, tgt_mask, tgt_mask, rare_tgt[tgt_in], True))
    for layer, w in enumerate(cross):
        table.add("cross", layer, head_sums(w, tgt_mask, src_mask, rare_src[src], False))
    return cross


@functools.lru_cache(maxsize=8)
def _rare(tokenizer: Any) -> Tensor:
    return rare_ids(tokenizer)


def sentence_heads(translator: Any, source: Sequence[str], target: Sequence[str], decimals: int = 3) -> dict[str, Any]:
    """One translation's heads, teacher-forced on its own output (what ``nmt-serve`` shows for
    ``"attention": "heads"``): ``source`` and ``target`` are the pieces of its ``Attention``, EOS
    last on both. ``weights``: the cross-attention of each layer and head, [layer][head][target
    piece][source piece] (rows and columns as the averaged heatmap's; empty for a decoder without
    heads); ``table``: the sentence's per-head statistics (``HeadTable.rows``, no AER, no importance)."""
    from nmt.data.tokenizer import BOS

    model, device = translator.model, translator.device
    kinds = attentions(model)
    src = torch.tensor([[translator.src_vocab.sp.piece_to_id(p) for p in source]], device=device)
    tgt_in = torch.tensor([[BOS, *(translator.tgt_vocab.sp.piece_to_id(p) for p in target[:-1])]], device=device)
    table = HeadTable()
    cross = add_batch(table, model, kinds, src, src != PAD, tgt_in, _rare(translator.src_vocab).to(device),
                      _rare(translator.tgt_vocab).to(device))
    weights = [np.round(w[0].float().cpu().numpy(), decimals).tolist() for w in cross]
    return {"weights": weights, "table": table.rows()}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table as markdown, a row per head."""
    columns = [c for c in COLUMNS if any(r[c] is not None for r in rows)]
    lines = ["| attention | layer | head | " + " | ".join("AER %" if c == "aer" else c for c in columns) + " |",
             "|---|---:|---:|" + "---:|" * len(columns)]
    for r in rows:
        cells = ["" if r[c] is None else f"{r[c]:.2f}" if c == "aer" else f"{r[c]:.3f}" for c in columns]
        lines.append(f"| {TITLES[r['kind']]} | {r['layer'] + 1} | {r['head'] + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str | Path, stat: str = "confidence", title: str = "") -> Path:
    """A layer x head grid of ``stat`` per kind, side by side (a pruned layer's missing heads blank)."""
    from nmt.evaluation.plots import figure, save

    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    layers = 1 + max(r["layer"] for r in rows)
    heads = 1 + max(r["head"] for r in rows)
    fig, ax = figure(max(4.0, 2.2 * len(kinds) * max(1, heads / 4)), max(2.5, 0.5 * layers + 1.5))
    fig.delaxes(ax)
    for i, kind in enumerate(kinds):
        grid = np.full((layers, heads), np.nan)
        for r in rows:
            if r["kind"] == kind and r[stat] is not None:
                grid[r["layer"], r["head"]] = r[stat]
        ax = fig.add_subplot(1, len(kinds), i + 1)
        image = ax.imshow(grid, cmap="viridis", aspect="auto", vmin=0.0, vmax=max(1.0, float(np.nanmax(grid))))
        ax.set_xticks(range(heads), [str(h + 1) for h in range(heads)])
        ax.set_yticks(range(layers), [str(n + 1) for n in range(layers)])
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(TITLES[kind], fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.05)
    fig.suptitle(title or stat, fontsize=9)
    return save(fig, ax, path)


def write(rows: list[dict[str, Any]], folder: str | Path, name: str = "", stat: str = "confidence") -> dict[str, Path]:
    """``heads.json``, ``heads.md`` and ``heads.png`` (``stat`` per head) in ``folder``."""
    from nmt.runs.files import json_text

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "heads.json", "md": folder / "heads.md", "png": folder / "heads.png"}
    paths["json"].write_text(json_text({"heads": rows}))
    paths["md"].write_text(markdown(rows))
    plot(rows, paths["png"], stat, f"{name}: {stat}" if name else stat)
    return paths

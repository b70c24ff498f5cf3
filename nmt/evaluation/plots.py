"""Figures: attention heatmaps, and the saving shared with the BLEU-by-length plot.

Drawn with matplotlib's object-oriented API (a ``Figure`` on an Agg canvas): no pyplot state, and
the process's backend is left as it is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def figure(width: float, height: float) -> tuple[Figure, Axes]:
    """A figure of ``width`` x ``height`` inches with one axes, drawn by Agg."""
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def literal(text: str) -> str:
    """``text`` drawn as it is: a ``$`` would start matplotlib's math mode (a piece ``$^^$`` is a
    parse error, ``$x$`` a formula)."""
    return text.replace("$", r"\$")


MAX_INCHES = 30.0  # a heatmap's side at most (3,600 pixels at 120 dpi): its memory is bounded whatever the line's length
MAX_LABELS = 100  # pieces named along an axis; a longer axis is drawn with numbered ticks


def plot_attention(attn, src_pieces: list[str], tgt_pieces: list[str], path: str | Path, title: str = "") -> Path:
    """Save a heatmap of ``attn`` (T target pieces x S source pieces; nested lists or an array) as PNG,
    at most ``MAX_INCHES`` a side, each piece named along an axis of at most ``MAX_LABELS`` pieces."""
    attn = np.asarray(attn, dtype=np.float32)
    rows, cols = attn.shape
    fig, ax = figure(min(MAX_INCHES, max(4.0, 0.3 * cols + 1.5)), min(MAX_INCHES, max(3.0, 0.3 * rows + 1.2)))
    ax.imshow(attn, cmap="Greys", aspect="auto", vmin=0.0, vmax=max(float(attn.max()), 1e-6))
    if cols <= MAX_LABELS:
        ax.set_xticks(range(cols), [literal(p) for p in src_pieces[:cols]], rotation=90, fontsize=7)
    if rows <= MAX_LABELS:
        ax.set_yticks(range(rows), [literal(p) for p in tgt_pieces[:rows]], fontsize=7)
    ax.set_xlabel("source")
    ax.set_ylabel("output")
    return save(fig, ax, path, title)


def save(fig: Figure, ax: Axes, path: str | Path, title: str = "") -> Path:
    """Title, tighten and write as PNG (folders made as needed)."""
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path

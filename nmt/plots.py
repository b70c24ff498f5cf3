"""Figures: attention heatmaps, and the saving shared with the BLEU-by-length plot."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from torch import Tensor  # noqa: E402


def plot_attention(attn: Tensor, src_pieces: list[str], tgt_pieces: list[str], path: str | Path, title: str = "") -> Path:
    """Save a heatmap of ``attn`` (T target pieces x S source pieces) as PNG."""
    attn = attn.float().cpu().numpy()
    rows, cols = attn.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.3 * cols + 1.5), max(3.0, 0.3 * rows + 1.2)))
    ax.imshow(attn, cmap="Greys", aspect="auto", vmin=0.0, vmax=max(float(attn.max()), 1e-6))
    ax.set_xticks(range(cols), src_pieces[:cols], rotation=90, fontsize=7)
    ax.set_yticks(range(rows), tgt_pieces[:rows], fontsize=7)
    ax.set_xlabel("source")
    ax.set_ylabel("output")
    return save(fig, ax, path, title)


def save(fig: plt.Figure, ax: plt.Axes, path: str | Path, title: str = "") -> Path:
    """Title, tighten, write as PNG (folders made as needed) and close the figure."""
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

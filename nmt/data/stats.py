"""Corpus statistics through the same path as training: `python -m nmt.data.stats data=multi30k`.

Per split: pairs, source/target words and subwords (mean / max), a source-length histogram
and what was dropped or truncated. A corpus that fails here fails the same way in training.
"""

from __future__ import annotations

import logging

import numpy as np
from hydra.utils import instantiate
from omegaconf import DictConfig

from nmt.cli_io import configured, hydra_command
from nmt.data.datamodule import TranslationDataModule
from nmt.data.sources import SPLITS

log = logging.getLogger(__name__)


def histogram(lengths: np.ndarray, width: int = 10, last: int = 100, bar: int = 40) -> list[str]:
    """Text bars of `lengths` in buckets 1-10, 11-20, ..., and one bucket above `last`."""
    edges = list(range(0, last + 1, width))
    counts = [int(((lengths > lo) & (lengths <= lo + width)).sum()) for lo in edges[:-1]]
    labels = [f"{lo + 1}-{lo + width}" for lo in edges[:-1]]
    counts.append(int((lengths > last).sum()))
    labels.append(f">{last}")
    while len(counts) > 1 and counts[-1] == 0:  # trim empty buckets at the long end
        counts.pop()
        labels.pop()
    top = max(counts) or 1
    return [f"  {label:>7} {count:8d} {'#' * round(bar * count / top)}"
            for label, count in zip(labels, counts)]


def _mean_max(x: np.ndarray) -> str:
    return f"{x.mean():7.1f} / {x.max():5d}" if len(x) else "      - /     -"


def report(dm: TranslationDataModule) -> str:
    """The statistics of a set-up datamodule as text."""
    unit = "chars" if dm.src_words == "chars" else "words"
    vocab = (f"joint {dm.src_vocab.vocab_size}" if dm.joint_vocab
             else f"{dm.src_vocab.vocab_size} / {dm.tgt_vocab.vocab_size}")
    lines = [f"{dm.src_lang} -> {dm.tgt_lang}; subword vocabulary {vocab}; "
             f"limits {dm.max_src_len}/{dm.max_tgt_len} subwords ({dm.too_long} long training "
             f"pairs); prepared in {dm.prepare_seconds:.1f}s"]
    for split in SPLITS:
        data, stats = dm.datasets[split], dm.stats[split]
        sub_src = np.diff(data.src[1])[data.index]
        sub_tgt = np.diff(data.tgt[1])[data.index] if data.tgt is not None else sub_src[:0]
        src_len = dm.text_lengths(split, "src")
        lines += [
            f"\n[{split}] {stats['pairs']} pairs (read {stats['read']}; dropped: "
            f"{stats['empty_dropped']} empty, {stats['too_long_dropped']} too long; truncated: "
            f"{stats['src_truncated']} source, {stats['tgt_truncated']} target)",
            "                      mean /   max",
            f"  source {unit:<8} {_mean_max(src_len)}",
            f"  target words    {_mean_max(dm.text_lengths(split, 'tgt'))}",
            f"  source subwords {_mean_max(sub_src)}",
            f"  target subwords {_mean_max(sub_tgt)}",
            f"  source length ({unit}):",
            *histogram(src_len),
        ]
    return "\n".join(lines)


def show_stats(cfg: DictConfig) -> None:
    """Log the statistics of the data ``cfg.data`` configures."""
    dm: TranslationDataModule = configured(lambda: instantiate(cfg.data, vocab_loader=instantiate(cfg.vocab_loader)))
    dm.setup()
    log.info("corpus statistics\n%s", report(dm))


main = hydra_command("stats", show_stats)  # python -m nmt.data.stats: nmt/conf/stats.yaml

if __name__ == "__main__":
    main()

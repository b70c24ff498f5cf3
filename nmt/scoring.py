"""Score given translations under a model (``translate.py mode=score``): quality estimation, data
filtering, reranking.

    python translate.py ckpt=<ckpt> mode=score input=src.txt target=hyp.txt > scores.tsv
    python translate.py ckpt=<ckpt> mode=score input=pairs.tsv              # source <TAB> target

Each pair's target (its SentencePiece ids and EOS) is scored teacher-forced through
``Seq2Seq.forward`` (``nmt.decoding.score_pairs``), in length-sorted batches, written in input
order: ``logprob <TAB> mean <TAB> tokens`` per line (the sum of the tokens' log-probabilities, its
mean per token, the number of tokens with EOS), and with ``score_tokens=true`` the per-token
values after one more tab, space-separated. JSON lines: ``line``, ``logprob``, ``mean``,
``tokens`` (and ``token_logprobs``). A pair with an empty source gives an empty line (JSON:
only ``line``). Sources and targets longer than the model's limits are truncated with a warning.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig

from nmt.data.batching import TokenBatchSampler
from nmt.data.tokenizer import Tokenizer
from nmt.decoding import score_pairs
from nmt.translate import (OrderedWriter, chunked, encode_sources, iter_lines, model_max_src_len, pad, prepare_model,
                           report_replaced, run_batches, tokens)

log = logging.getLogger(__name__)

_END = object()


def read_pairs(source: str | None, target: str | None, errors: str, replaced: list[int],
               replaced_targets: list[int] | None = None) -> Iterator[tuple[str, str]]:
    """(source, target) per line: two files read in step (an error when one ends first), or one
    file of ``source<TAB>target`` lines when ``target`` is None."""
    if target is None:
        for number, line in enumerate(iter_lines(source, errors, replaced), start=1):
            if "\t" not in line:
                if not line.strip():
                    yield "", ""
                    continue
                raise ValueError(f"{source or '<stdin>'}, line {number}: no tab; give source<TAB>target lines, "
                                 "or the targets in their own file with target=<file>")
            src, tgt = line.split("\t", 1)
            yield src, tgt
        return
    sources, targets = iter_lines(source, errors, replaced), iter_lines(target, errors, replaced_targets)
    for number, (src, tgt) in enumerate(itertools.zip_longest(sources, targets, fillvalue=_END), start=1):
        if src is _END or tgt is _END:
            short, long = (source or "<stdin>", target) if src is _END else (target, source or "<stdin>")
            raise ValueError(f"{short} has {number - 1} lines but {long} has more: give one target per source line")
        yield src, tgt


def model_max_tgt_len(run_config: dict[str, Any], model: torch.nn.Module) -> int:
    limit = tokens(run_config.get("data", {}).get("max_tgt_len", 256), "data.max_tgt_len")
    table = getattr(getattr(model.decoder, "embed_tokens", None), "max_len", None)
    return min(limit, int(table)) if table else limit


def score_lines(model: torch.nn.Module, src_vocab: Tokenizer, tgt_vocab: Tokenizer, sources: list[str], targets: list[str],
                max_tokens: int = 2048, max_src_len: int = 256, max_tgt_len: int = 256, precision: str = "32",
                workers: int | None = None, first_line: int = 1) -> Iterator[tuple[list[int], list[list[float]]]]:
    """Per-token log-probabilities of each target given its source, for the pairs with a
    non-empty source; yields, batch after batch, the 0-based indices and their per-token values
    (EOS last)."""
    device = next(model.parameters()).device
    todo = [i for i, s in enumerate(sources) if s.strip()]
    numbers = [first_line + i for i in todo]
    src_ids = encode_sources([sources[i] for i in todo], src_vocab, max_src_len, numbers)
    tgt_ids = encode_sources([targets[i] for i in todo], tgt_vocab, max_tgt_len, numbers)  # ids + EOS, truncated
    lengths = [[len(s), len(t)] for s, t in zip(src_ids, tgt_ids)]
    batches = list(TokenBatchSampler(lengths, max_tokens=max_tokens, batch_size=None, shuffle=False, seed=0)) if todo else []

    def work(batch: list[int]):
        src, src_mask = pad([src_ids[j] for j in batch], device)
        tgt, _ = pad([tgt_ids[j] for j in batch], device)
        values = score_pairs(model, src, src_mask, tgt).float().cpu()
        return [todo[j] for j in batch], [values[r, : len(tgt_ids[j])].tolist() for r, j in enumerate(batch)]

    yield from run_batches(batches, work, device, precision, workers)


def score_row(number: int, values: list[float] | None, fmt: str, per_token: bool) -> str:
    if values is None:  # an empty source
        return json.dumps({"line": number}) if fmt == "jsonl" else ""
    total = sum(values)
    if fmt == "jsonl":
        row = {"line": number, "logprob": round(total, 4), "mean": round(total / len(values), 4), "tokens": len(values)}
        if per_token:
            row["token_logprobs"] = [round(v, 4) for v in values]
        return json.dumps(row)
    row = f"{total:.4f}\t{total / len(values):.4f}\t{len(values)}"
    return row + ("\t" + " ".join(f"{v:.4f}" for v in values) if per_token else "")


def score_stream(cfg: DictConfig, loaded, writer: OrderedWriter, fmt: str) -> int:
    """Score the pairs of ``cfg.input`` (and ``cfg.target``) chunk by chunk into ``writer``."""
    model = prepare_model(loaded.model, cfg.precision)
    max_src_len, max_tgt_len = model_max_src_len(loaded.run_config), model_max_tgt_len(loaded.run_config, model)
    replaced: list[int] = []
    replaced_targets: list[int] = []
    offset = 0
    for chunk in chunked(read_pairs(cfg.input, cfg.get("target"), cfg.errors, replaced, replaced_targets),
                         int(cfg.chunk_lines)):
        sources, targets = [s for s, _ in chunk], [t for _, t in chunk]
        for i, src in enumerate(sources):
            if not src.strip():
                writer.put(offset + i, [score_row(offset + i + 1, None, fmt, cfg.score_tokens)])
        writer.flush()
        for rows, values in score_lines(model, loaded.src_vocab, loaded.tgt_vocab, sources, targets, cfg.max_tokens,
                                        max_src_len, max_tgt_len, cfg.precision, cfg.workers, first_line=offset + 1):
            for i, v in zip(rows, values):
                writer.put(offset + i, [score_row(offset + i + 1, v, fmt, cfg.score_tokens)])
            writer.flush()
        offset += len(chunk)
    report_replaced(cfg.input, replaced)
    report_replaced(cfg.get("target"), replaced_targets)
    return offset


"""Translate text with a trained checkpoint: ``python translate.py ckpt=<run>/checkpoints/last.ckpt
< in.txt > out.txt`` (or ``input=in.txt output=out.txt``; see ``nmt/conf/translate.yaml``).

A checkpoint carries its run's resolved config and SentencePiece models, so nothing else is
needed. Exactly one output line is written per input line: empty input lines stay empty, over-long
lines are truncated to the model's limit with a warning, invalid UTF-8 is an error naming the line
(or, with ``errors=replace``, replaced and reported).
"""

from __future__ import annotations

import copy
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from nmt import CONF_DIR
from nmt.checkpoint import load_checkpoint
from nmt.data.batching import TokenBatchSampler
from nmt.data.tokenizer import EOS, PAD, Tokenizer
from nmt.malloc import keep_freed_memory
from nmt.quantize import quantize_int8

log = logging.getLogger(__name__)


def read_lines(path: str | None, errors: str = "strict") -> list[str]:
    """Lines of a file (stdin when ``path`` is None) without their newline; invalid UTF-8 raises
    with the line number, or is replaced (U+FFFD) and reported when ``errors="replace"``."""
    stream = sys.stdin.buffer if path is None else open(path, "rb")
    name = "<stdin>" if path is None else path
    lines, bad = [], []
    with stream:
        for number, raw in enumerate(stream, start=1):
            raw = raw.rstrip(b"\r\n")
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                if errors != "replace":
                    raise ValueError(
                        f"{name}, line {number}: invalid UTF-8 ({err.reason} at byte {err.start}); "
                        f"fix the file or run with errors=replace"
                    ) from None
                lines.append(raw.decode("utf-8", errors="replace"))
                bad.append(number)
    if bad:
        log.warning("%s: replaced invalid UTF-8 on %d line(s): %s", name, len(bad), bad[:20])
    return lines


def encode_sources(lines: list[str], src_vocab: Tokenizer, max_len: int,
                   numbers: list[int] | None = None) -> list[list[int]]:
    """Subword ids + EOS per line; lines longer than ``max_len`` tokens are truncated, and the
    warning names them by ``numbers`` (their 1-based input line numbers; default 1..n)."""
    encoded, truncated = [], []
    for i, ids in enumerate(src_vocab.encode_batch(lines)):
        if len(ids) > max_len - 1:
            truncated.append(numbers[i] if numbers else i + 1)
            ids = ids[: max_len - 1]
        encoded.append(ids + [EOS])
    if truncated:
        log.warning("truncated %d line(s) longer than %d tokens: %s", len(truncated), max_len - 1, truncated[:20])
    return encoded


def _pad(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.full((len(seqs), max(map(len, seqs))), PAD, dtype=torch.long)
    for i, seq in enumerate(seqs):
        src[i, : len(seq)] = torch.tensor(seq)
    src = src.to(device)
    return src, src != PAD


PRECISIONS = ("32", "bf16", "int8")


@torch.no_grad()
def translate_lines(
    model: torch.nn.Module,
    src_vocab: Tokenizer,
    tgt_vocab: Tokenizer,
    lines: list[str],
    search: Callable[..., Any],
    max_tokens: int = 2048,
    max_src_len: int = 256,
    attention_lines: Iterable[int] = (),
    precision: str = "32",
    workers: int | None = None,
) -> tuple[list[str], dict[int, tuple[torch.Tensor, list[str], list[str]]]]:
    """Translate ``lines`` in length-sorted batches; returns one hypothesis per line (empty for
    an empty line) and, for the 0-based ``attention_lines``, (attention (T, S), source pieces,
    target pieces). ``precision="bf16"`` decodes under bf16 autocast (matmuls in bf16, scores
    and softmax in fp32); ``precision="int8"`` (CPU) with a copy of the model whose linear layers
    multiply in int8 (``nmt.quantize``), the rest in fp32.

    On a CPU, ``workers`` batches decode at once, each on one thread (default: as many as torch
    has threads): a decoding step is many small operations that one thread runs nearly as fast
    as two, so batches side by side use the cores better than threads inside each operation."""
    if str(precision) not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)}")
    model.eval()
    device = next(model.parameters()).device
    if str(precision) == "int8":
        model = quantize_int8(copy.deepcopy(model))
    wanted = set(attention_lines)
    outputs = [""] * len(lines)
    attentions: dict[int, tuple[torch.Tensor, list[str], list[str]]] = {}
    todo = [i for i, line in enumerate(lines) if line.strip()]
    encoded = encode_sources([lines[i] for i in todo], src_vocab, max_src_len, numbers=[i + 1 for i in todo])
    batches = list(TokenBatchSampler([len(e) for e in encoded], max_tokens=max_tokens, batch_size=None, shuffle=False, seed=0))

    def decode(batch: list[int]) -> tuple[list[int], bool, Any]:
        src, src_mask = _pad([encoded[j] for j in batch], device)
        need_attn = any(todo[j] in wanted for j in batch)
        # Grad mode and autocast are per thread: set them in the thread that decodes.
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=str(precision) == "bf16"):
            return batch, need_attn, search(model, src, src_mask, need_attn=need_attn)

    workers = min(workers or torch.get_num_threads(), len(batches)) if device.type == "cpu" else 1
    if workers > 1:
        threads = torch.get_num_threads()
        pool = ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,))
        try:
            results = list(pool.map(decode, batches))
        finally:
            pool.shutdown(cancel_futures=True)  # after an error, the batches not started are dropped
            torch.set_num_threads(threads)  # the workers' setting is process-wide
    else:
        results = map(decode, batches)
    for batch, need_attn, hyps in results:
        for row, j in enumerate(batch):
            outputs[todo[j]] = tgt_vocab.decode(hyps.tokens[row])
            if need_attn and hyps.attn is not None and todo[j] in wanted:
                src_len = len(encoded[j])
                attentions[todo[j]] = (
                    hyps.attn[row][:, :src_len],
                    src_vocab.pieces(encoded[j]),
                    tgt_vocab.pieces(hyps.tokens[row] + [EOS]),
                )
    return outputs, attentions


def model_max_src_len(run_config: dict[str, Any]) -> int:
    """The longest source the model accepts: the data config's limit, capped by a Transformer
    encoder's position table."""
    limit = int(run_config.get("data", {}).get("max_src_len", 256))
    encoder_max = run_config.get("model", {}).get("encoder", {}).get("max_len")
    return min(limit, int(encoder_max)) if encoder_max else limit


@hydra.main(config_path=CONF_DIR, config_name="translate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    gpu = torch.cuda.is_available() and str(cfg.precision) != "int8"  # int8 decodes on CPUs
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if gpu else "cpu"))
    keep_freed_memory()
    loaded = load_checkpoint(cfg.ckpt, device=device, allow_pickle=cfg.allow_pickle)
    lines = read_lines(cfg.input, errors=cfg.errors)
    search = instantiate(cfg.decoding)
    max_src_len = model_max_src_len(loaded.run_config)
    outputs, attentions = translate_lines(
        loaded.model, loaded.src_vocab, loaded.tgt_vocab, lines, search, cfg.max_tokens, max_src_len, cfg.attention_lines,
        cfg.precision, cfg.workers,
    )
    text = "".join(line + "\n" for line in outputs)
    if cfg.output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        Path(cfg.output).write_text(text, encoding="utf-8")
    if attentions:
        from nmt.plots import plot_attention  # matplotlib loads only when heatmaps are asked for
    for i, (attn, src_pieces, tgt_pieces) in sorted(attentions.items()):
        path = Path(cfg.attention_dir) / f"line{i + 1:05d}.png"
        plot_attention(attn, src_pieces, tgt_pieces, path, title=f"line {i + 1}")
        log.info("attention of line %d -> %s", i + 1, path)
    log.info("translated %d lines (%d empty) with %s", len(lines), sum(not l.strip() for l in lines), OmegaConf.to_container(cfg.decoding))


if __name__ == "__main__":
    main()

"""Decoding speed, and decoding without the key/value cache to compare it with."""

from __future__ import annotations

import time

import torch

from nmt.bench.measure import sync, to_device


def decode_speed(model, batches: list[dict], search, device: torch.device, autocast,
                 warm_whole: bool = False) -> tuple[dict[str, float], list]:
    """Sentences/s and output tokens/s (EOS included) of ``search`` over ``batches``; and the outputs.
    The warm-up decodes the first batch's first sentence, or (``warm_whole``) the whole first batch:
    a search that captures a CUDA graph per batch shape captures it there."""
    model.eval()
    first = to_device(batches[0], device)
    rows = first["src"].size(0) if warm_whole else 1
    with torch.no_grad(), autocast():
        search(model, first["src"][:rows], first["src_mask"][:rows])  # warm-up
        sync(device)
        start = time.perf_counter()
        sentences = tokens = 0
        outputs = []
        for batch in batches:
            batch = to_device(batch, device)
            hyps = search(model, batch["src"], batch["src_mask"])
            outputs.extend(hyps.tokens)
            sentences += len(hyps.tokens)
            tokens += sum(len(t) + 1 for t in hyps.tokens)
        sync(device)
    seconds = time.perf_counter() - start
    return {"sentences_per_s": sentences / seconds, "tokens_per_s": tokens / seconds, "seconds": seconds}, outputs


class NoCache(torch.nn.Module):
    """A Seq2Seq whose ``decode_step`` re-runs the decoder over the whole prefix and keeps the
    last position, as Joey NMT's search does, instead of extending a key/value cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.tgt_vocab_size = model.tgt_vocab_size
        self.kernels = model.kernels  # decoding normalises the logits through them

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.model.encode(src, src_mask)

    def init_state(self, memory: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mask = memory["src_mask"]
        return {"prefix": torch.zeros(mask.size(0), 0, dtype=torch.long, device=mask.device)}  # (B, t)

    def decode_step(self, prev, memory, state, need_attn: bool = False):
        prefix = torch.cat([state["prefix"], prev.unsqueeze(1)], dim=1)
        return self.model.decoder(prefix, memory)[:, -1], {"prefix": prefix}, None

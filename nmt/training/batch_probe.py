"""``data.max_tokens=auto``: the largest token batch that fits the GPU, found at start.

The probe builds batches as wide as the longest training pair (its length bucket under
``data.shapes=buckets``) and runs a whole training step on each (forward, backward and an
optimizer step of the run's optimizer class at learning rate 0, under the run's precision), from
``START`` tokens doubling until one does not fit, then halving the gap to within ``RESOLUTION``.
The run trains on ``1 - HEADROOM`` of the largest that fit (batches of other lengths, the
allocator's fragmentation and validation need some room), and the last step run is at that size,
so the caching allocator starts the run holding the blocks of its largest batch. The weights, the
optimizer the run builds and the random streams are as they were before the probe.

On a CPU ``auto`` trains on ``CPU_TOKENS`` tokens (a CPU's memory is not what limits its batch; its
speed is), logged.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

START = 4096
RESOLUTION = 1024  # tokens: the search stops when the gap between fitting and not is this small
HEADROOM = 0.1
LIMIT = 1 << 20  # tokens: no probe goes beyond (a million tokens a batch)
CPU_TOKENS = 4096
FIRST_ID = 4  # ids from here on are ordinary pieces (nmt.specials: PAD, UNK, BOS, EOS)


def largest_fitting(fits: Callable[[int], bool], start: int = START, limit: int = LIMIT,
                    resolution: int = RESOLUTION) -> tuple[int, list[tuple[int, bool]]]:
    """The largest token count (a multiple of ``resolution``, at most ``limit``) for which
    ``fits(tokens)`` held, searched by doubling from ``start`` then bisecting; 0 if not even
    ``resolution`` fits. Returns it and every try as (tokens, fitted)."""
    tries: list[tuple[int, bool]] = []

    def attempt(tokens: int) -> bool:
        ok = fits(tokens)
        tries.append((tokens, ok))
        return ok

    good, bad = 0, None
    tokens = max(resolution, min(start, limit) // resolution * resolution)
    while True:
        if attempt(tokens):
            good = tokens
            if tokens >= limit:
                return good, tries
            tokens = min(limit, tokens * 2)
        else:
            bad = tokens
            break
    if good == 0:  # even the start failed: search below it
        low = 0
        while bad - low > resolution:
            mid = (low + bad) // 2 // resolution * resolution
            if mid <= low:
                break
            if attempt(mid):
                low = good = mid
            else:
                bad = mid
        return good, tries
    while bad - good > resolution:
        mid = (good + bad) // 2 // resolution * resolution
        if mid <= good:
            break
        if attempt(mid):
            good = mid
        else:
            bad = mid
    return good, tries


def training_step_of(model: torch.nn.Module, optimizer_factory: Callable[..., torch.optim.Optimizer],
                     loss_fn: Callable[[dict[str, Any]], torch.Tensor], widths: tuple[int, int], vocab: tuple[int, int],
                     device: torch.device, precision: str) -> Callable[[int], None]:
    """A function running one training step on a synthetic batch of ``tokens`` tokens a side, as
    wide as ``widths`` (source, target): the model's training pass through ``loss_fn`` (the
    module's loss on a batch dict), backward, and a step of ``optimizer_factory`` at rate 0."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_factory(params=params, lr=0.0)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None else nullcontext

    def step(tokens: int) -> None:
        rows = max(1, tokens // max(widths))
        generator = torch.Generator(device="cpu").manual_seed(tokens)
        src = torch.randint(FIRST_ID, vocab[0], (rows, widths[0]), generator=generator).to(device)
        tgt = torch.randint(FIRST_ID, vocab[1], (rows, widths[1]), generator=generator).to(device)
        batch = {"src": src, "src_mask": torch.ones_like(src, dtype=torch.bool), "tgt_in": tgt, "tgt_out": tgt}
        try:
            with autocast():
                loss = loss_fn(batch)
            loss.backward()
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=True)
            optimizer.state.clear()

    return step


def probe_max_tokens(step: Callable[[int], None], device: torch.device) -> dict[str, Any]:
    """The batch the run trains on: the largest that ``step`` ran without running out of memory,
    less ``HEADROOM``, with the tries; the random streams are left as they were."""
    def fits(tokens: int) -> bool:
        try:
            step(tokens)
            return True
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return False

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        largest, tries = largest_fitting(fits, START, LIMIT, RESOLUTION)
        if largest == 0:
            raise RuntimeError(f"data.max_tokens=auto: not even a batch of {RESOLUTION} tokens of the longest training "
                               "pair fits this GPU's free memory; set data.max_tokens, data.max_src_len/max_tgt_len, "
                               "or model.gradient_checkpointing=true")
        chosen = max(RESOLUTION, int(largest * (1 - HEADROOM)) // 8 * 8)
        step(chosen)  # the allocator keeps the blocks of the largest batch the run trains on
    return {"max_tokens": chosen, "largest_fitting": largest, "tries": [list(t) for t in tries]}

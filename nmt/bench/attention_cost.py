"""The cost of each self-attention pattern (``nmt.models.attention_patterns``) against sequence
length: time of one attention layer and of one whole encoder layer, forward and forward+backward,
the bytes autograd keeps for the backward pass, the exponent of time in n fitted on a log-log
scale, and the length from which each pattern beats full attention (SDPA).
``scripts/benchmark_attention.py`` runs it on a CPU; the GPU check's ``attention`` part on a GPU."""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from nmt.bench.measure import SavedBytes, peak_memory_mb, reset_peak_memory, sync
from nmt.models.attention_patterns import make_pattern
from nmt.models.transformer import EncoderLayer

# The patterns measured, with options sized for sentences of tens to thousands of tokens.
VARIANTS: dict[str, dict[str, Any]] = {
    "full": {"attention": "full"},
    "local": {"attention": "local", "window": 32},
    "local_global": {"attention": "local_global", "window": 32, "global_tokens": 8},
    "block_sparse": {"attention": "block_sparse", "block_size": 32, "global_blocks": 1, "random_blocks": 2},
    "low_rank": {"attention": "low_rank", "rank": 64},
}
CLAIMED = {"full": "O(n^2)", "local": "O(n*w)", "local_global": "O(n*(w+g))", "block_sparse": "O(n*b*(3+g+r))", "low_rank": "O(n*k)"}
LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
FIT_FROM = 256  # the exponent is fitted on lengths from here up, where per-call overheads no longer dominate


def layer_for(variant: str, hidden: int, heads: int, ff: int, max_len: int, device: torch.device) -> EncoderLayer:
    options = dict(VARIANTS[variant])
    layer = EncoderLayer(hidden, heads, ff, dropout=0.0, norm="pre", rotary=None)
    layer.self_attn.pattern = make_pattern("encoder", options.pop("attention"), max_len, **options)
    return layer.to(device)


def best_time(work: Callable[[], Any], device: torch.device, repeats: int) -> float:
    work()  # warm-up: allocations, the pattern's tables
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def measure(variant: str, n: int, device: torch.device, hidden: int = 256, heads: int = 4, ff: int = 1024,
            repeats: int = 3, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """One pattern at length n (batch of one sentence): seconds of the attention alone and of the
    whole layer, forward and forward+backward, and the bytes saved for backward by each."""
    torch.manual_seed(0)
    layer = layer_for(variant, hidden, heads, ff, max(n, 64), device)
    x = torch.randn(1, n, hidden, device=device, requires_grad=True)
    mask = torch.ones(1, 1, 1, n, dtype=torch.bool, device=device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    def attention():
        return layer._attend(x, mask, None)

    def whole():
        return layer(x, mask)

    row: dict[str, Any] = {"variant": variant, "n": n}
    for name, fn in (("attention", attention), ("layer", whole)):
        def forward():
            with torch.no_grad(), autocast:
                fn()

        def backward():
            with autocast:
                out = fn()
            out.float().sum().backward()
            layer.zero_grad(set_to_none=True)
            x.grad = None

        row[f"{name}_forward_s"] = best_time(forward, device, repeats)
        row[f"{name}_backward_s"] = best_time(backward, device, repeats)
        saved = SavedBytes()
        reset_peak_memory(device)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), autocast:
            out = fn()
        row[f"{name}_saved_mb"] = saved.total / 2**20
        del out
        if device.type == "cuda":
            backward()
            row[f"{name}_peak_mb"] = peak_memory_mb(device)
    return row


def exponent(rows: list[dict[str, Any]], key: str, from_n: int = FIT_FROM) -> float | None:
    """The least-squares slope of log(time) against log(n) over the lengths from ``from_n``."""
    points = [(math.log(r["n"]), math.log(r[key])) for r in rows if r["n"] >= from_n and r[key] > 0]
    if len(points) < 2:
        return None
    mx, my = (sum(p[i] for p in points) / len(points) for i in (0, 1))
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def crossover(rows: list[dict[str, Any]], full: list[dict[str, Any]], key: str) -> int | None:
    """The shortest length from which the pattern is faster than full attention at every longer
    length measured; None if it never is (at the longest)."""
    by_n = {r["n"]: r[key] for r in full}
    faster = [(r["n"], r[key] < by_n[r["n"]]) for r in sorted(rows, key=lambda r: r["n"]) if r["n"] in by_n]
    found = None
    for n, wins in reversed(faster):
        if not wins:
            break
        found = n
    return found


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per pattern: the claimed complexity, the fitted exponents and the crossovers (forward+backward)."""
    full = [r for r in rows if r["variant"] == "full"]
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        at = {r["n"]: r for r in mine}
        out[variant] = {
            "claimed": CLAIMED[variant], "options": {k: v for k, v in VARIANTS[variant].items() if k != "attention"},
            "exponent_attention": exponent(mine, "attention_backward_s"), "exponent_layer": exponent(mine, "layer_backward_s"),
            "crossover_attention": crossover(mine, full, "attention_backward_s") if variant != "full" else None,
            "crossover_layer": crossover(mine, full, "layer_backward_s") if variant != "full" else None,
            **{f"saved_mb_{n}": at[n]["layer_saved_mb"] for n in (1024, 4096) if n in at},
            **{f"peak_mb_{n}": at[n]["layer_peak_mb"] for n in (1024, 4096) if n in at and "layer_peak_mb" in at[n]},
        }
    return out

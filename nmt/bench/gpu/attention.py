"""Part 8 of the GPU check: the attention patterns' cost curve (``nmt.bench.attention_cost``) on
the device in bf16, n from 64 to 4,096 (16 to 64 in a dry run): time of one attention layer and one
encoder layer, forward+backward, peak memory, the fitted exponents and the crossover lengths."""

from __future__ import annotations

from typing import Any

import torch

from nmt.bench.attention_cost import VARIANTS, measure, summary
from nmt.bench.gpu.check import Check

LENGTHS = (64, 256, 1024, 4096)
TINY = (16, 32, 64)


def attention(check: Check, result: dict[str, Any]) -> None:
    rows = result.setdefault("rows", [])
    dtype = torch.bfloat16 if check.mode.cuda else None
    for variant in VARIANTS:
        for n in TINY if check.mode.tiny else LENGTHS:
            row = measure(variant, n, check.device, hidden=16 if check.mode.tiny else 256, heads=2 if check.mode.tiny else 4,
                          ff=32 if check.mode.tiny else 1024, repeats=1 if check.mode.tiny else 3, dtype=dtype)
            rows.append(row)
        check.say(f"attention {variant}: " + ", ".join(f"n={r['n']} {1000 * r['layer_backward_s']:.2f} ms"
                                                        for r in rows if r["variant"] == variant))
    result["summary"] = summary(rows)

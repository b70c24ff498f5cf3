"""Part 6 of the GPU check: beam 5 at batch 64 with and without the key/value cache
(``nmt.bench.decoding.NoCache``), with the Transformers trained in parts 2-3 where they ran."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from nmt.bench.decoding import NoCache, decode_speed
from nmt.bench.gpu.check import Check
from nmt.training.builders import build_model
from nmt.decoding.search import beam_search

KV_TARGET = 5.0  # the speedup the cache should give


def kv_cache(check: Check, result: dict[str, Any]) -> None:
    rows = result.setdefault("runs", [])
    check.per_preset(rows, ("transformer", "transformer_base"), lambda preset: _kv(check, preset),
                     lambda preset, r: f"kv cache {preset}: {r['speedup']:.2f}x ({r['weights']}), same outputs {r['same_outputs']}")
    if any("error" in r for r in rows):
        raise RuntimeError("; ".join(f"{r['model']}: {r['error']}" for r in rows if "error" in r))


def _kv(check: Check, preset: str, beam_size: int = 5, batch_size: int = 64) -> dict[str, Any]:
    cfg = check.preset_config(preset, f"kv-{preset}")
    dm = check.datamodule()
    model = check.models.get(preset)
    weights = "after its bf16-mixed training above"
    if model is None:
        torch.manual_seed(0)
        model = build_model(cfg, dm.src_vocab.vocab_size, dm.tgt_vocab.vocab_size)
        weights = "random (its training did not run)"
    check.models.pop(preset, None)
    model = model.to(check.device).eval()
    beam = cfg.test_decoding
    search = partial(beam_search, beam_size=beam_size, alpha=beam.alpha, max_len_a=beam.max_len_a, max_len_b=beam.max_len_b)
    sources = dm.raw("test")[0][:batch_size]
    batches = list(dm.predict_loader(sources, batch_size=batch_size))[:1]
    autocast = check.autocast()
    cached, out_cached = decode_speed(model, batches, search, check.device, autocast)
    uncached, out_uncached = decode_speed(NoCache(model), batches, search, check.device, autocast)
    speedup = uncached["seconds"] / cached["seconds"]
    return {"model": preset, "weights": weights, "beam_size": beam_size, "batch_size": batch_size,
            "sentences": len(out_cached), "output_tokens": sum(len(t) + 1 for t in out_cached),
            "cached": cached, "uncached": uncached, "speedup": speedup, "target": KV_TARGET,
            "target_met": speedup >= KV_TARGET, "same_outputs": out_cached == out_uncached}

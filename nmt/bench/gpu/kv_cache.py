"""Part 6 of the GPU check: beam 5 at batch 64, with the Transformers trained in parts 2-3 where they
ran. The same batch is decoded by ``decoding.engine=loop`` (the search before fixed shapes: it reads
the device every step and shrinks the batch), by ``graphs`` (fixed shapes, one CUDA graph replayed
per step), without the key/value cache (``nmt.bench.decoding.NoCache``, the prefix re-run every
step), and by CTranslate2 on the same weights (``nmt-export``'s conversion, float16 on a GPU). In fp32
(TF32 off) ``graphs`` must give the loop's hypotheses, a first search and a replay of its capture alike:
the part fails otherwise."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf, open_dict
from torch.profiler import ProfilerActivity, profile

from nmt.bench.decoding import NoCache, decode_speed
from nmt.bench.gpu.check import Check, first_line
from nmt.bench.measure import sync, to_device
from nmt.exporters.ctranslate2 import to_ctranslate2
from nmt.decoding import search as searches
from nmt.decoding.search import beam_search, length_cap
from nmt.training.builders import build_model

KV_TARGET = 3.0  # the key/value cache against re-running the prefix
SCORE_TOLERANCE = 1e-4  # fp32: graphs' scores against the loop's (relative; masked cache positions move last bits)
CT2_TARGET = 0.5  # our fastest engine's tokens/s against CTranslate2's on the same weights


def kv_cache(check: Check, result: dict[str, Any]) -> None:
    rows = result.setdefault("runs", [])
    check.per_preset(rows, ("transformer", "transformer_base"), lambda preset: _decode(check, preset),
                     lambda preset, r: f"beam search {preset}: graphs {r['graphs_over_loop']:.2f}x the loop, cache "
                                       f"{r['speedup']:.2f}x, {_against(r)} CTranslate2 ({r['weights']})")
    if any("error" in r for r in rows):
        raise RuntimeError("; ".join(f"{r['model']}: {r['error']}" for r in rows if "error" in r))


def _against(row: dict[str, Any]) -> str:
    ratio = row.get("against_ctranslate2")
    return f"{ratio:.2f}x" if ratio is not None else f"no ({row['ctranslate2'].get('error')})"


def _decode(check: Check, preset: str, beam_size: int = 5, batch_size: int = 64) -> dict[str, Any]:
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
    engines, outputs = {}, {}
    for engine in ("loop", "graphs"):  # graphs: warmed on the batch itself, so its capture is not timed
        engines[engine], outputs[engine] = decode_speed(model, batches, partial(search, engine=engine), check.device,
                                                        autocast, warm_whole=True)
    engines["no_cache"], outputs["no_cache"] = decode_speed(NoCache(model), batches, partial(search, engine="loop"),
                                                            check.device, autocast)
    for engine in ("loop", "graphs"):
        engines[engine]["host"] = _host_work(check, model, batches[0], partial(search, engine=engine), autocast)
    speedup = engines["no_cache"]["seconds"] / engines["graphs"]["seconds"]
    row = {"model": preset, "weights": weights, "beam_size": beam_size, "batch_size": batch_size,
           "sentences": len(outputs["loop"]), "output_tokens": sum(len(t) + 1 for t in outputs["loop"]),
           "engines": engines, "cached": engines["graphs"], "uncached": engines["no_cache"],
           "graphs_over_loop": engines["loop"]["seconds"] / engines["graphs"]["seconds"],
           "loop_speedup": engines["no_cache"]["seconds"] / engines["loop"]["seconds"],
           "speedup": speedup, "target": KV_TARGET, "target_met": speedup >= KV_TARGET,
           "same_outputs": outputs["graphs"] == outputs["loop"] == outputs["no_cache"],
           "same_outputs_share": sum(a == b for a, b in zip(outputs["graphs"], outputs["loop"])) / len(outputs["loop"]),
           "fp32": _fp32_parity(model, batches[0], search, check.device), "fell_back": searches.fell_back(model)}
    if row["fell_back"]:
        raise RuntimeError(f"{preset}: the fixed-shape search disagreed with the loop in its self-check and fell back")
    try:
        row["ctranslate2"] = _ctranslate2(check, preset, model, cfg, dm, sources, beam_size, beam)
    except Exception as exc:  # noqa: BLE001  (the comparison is recorded as missing, our numbers stand)
        row["ctranslate2"] = {"error": first_line(exc)}
    if "tokens_per_s" in row["ctranslate2"]:
        ours = max(engines["graphs"]["tokens_per_s"], engines["loop"]["tokens_per_s"])
        row["against_ctranslate2"] = ours / row["ctranslate2"]["tokens_per_s"]
        row["ct2_target"], row["ct2_target_met"] = CT2_TARGET, row["against_ctranslate2"] >= CT2_TARGET
    return row


def _fp32_parity(model, batch: dict, search, device: torch.device) -> dict[str, Any]:
    """``batch`` decoded in fp32 (TF32 off) by the loop and twice by ``graphs`` (a capture, then a
    replay in the kept tensors): the same tokens, scores within ``SCORE_TOLERANCE``, or a RuntimeError."""
    batch = to_device(batch, device)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 here
        with torch.no_grad():
            loop = search(model, batch["src"], batch["src_mask"], engine="loop")
            graphs = [search(model, batch["src"], batch["src_mask"], engine="graphs") for _ in range(2)]
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    want = loop.scores.float().cpu()
    differing = [sum(a != b for a, b in zip(g.tokens, loop.tokens)) for g in graphs]
    score_diff = max(float(((g.scores.float().cpu() - want).abs() / want.abs().clamp(min=1.0)).max()) for g in graphs)
    row = {"sentences": len(loop.tokens), "differing": differing, "max_score_rel_diff": score_diff,
           "score_tolerance": SCORE_TOLERANCE}
    if any(differing) or not score_diff <= SCORE_TOLERANCE:
        raise RuntimeError(f"in fp32, engine=graphs differs from the loop: {differing[0]} and {differing[1]} of "
                           f"{len(loop.tokens)} hypotheses (capture, replay), scores by up to {score_diff:.3g} "
                           f"(relative; tolerance {SCORE_TOLERANCE:g})")
    return row


def _ctranslate2(check: Check, preset: str, model, cfg, dm, sources: list[str], beam_size: int, beam) -> dict[str, Any]:
    """CTranslate2 on the same weights and sentences: the export ``nmt-export format=ctranslate2``
    writes (float16 on a GPU, float32 on a CPU), one ``translate_batch`` of the pieces (SentencePiece
    outside the timing, as our searches get ids), beam ``beam_size``, the same length cap."""
    try:
        import ctranslate2
    except ImportError:
        return {"error": "ctranslate2 is not installed (scripts/gpu_wheels.sh carries its wheel)"}
    device = "cuda" if check.mode.cuda else "cpu"
    if device == "cuda" and ctranslate2.get_cuda_device_count() == 0:
        return {"error": f"ctranslate2 {ctranslate2.__version__} sees no CUDA device (a CPU-only build?)"}
    compute = "float16" if device == "cuda" else "float32"
    folder = Path(check.work) / f"ct2-{preset}"
    with open_dict(cfg):  # the sizes build_model fills in (the config of a model trained above left them unset)
        cfg.model.src_vocab_size, cfg.model.tgt_vocab_size = dm.src_vocab.vocab_size, dm.tgt_vocab.vocab_size
    run_config = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("data", "model", "test_decoding")}
    to_ctranslate2(model.float(), dm.src_vocab, dm.tgt_vocab, run_config, folder, quantization=compute)
    translator = ctranslate2.Translator(str(folder), device=device, compute_type=compute)
    pieces = [dm.src_vocab.sp.encode(line, out_type=str) for line in sources]
    cap = length_cap(max(len(p) for p in pieces) + 1, beam.max_len_a, beam.max_len_b)
    options = {"beam_size": beam_size, "max_batch_size": len(pieces), "max_decoding_length": cap, "return_scores": False}
    translator.translate_batch(pieces, **options)  # warm-up
    sync(check.device)
    start = time.perf_counter()
    results = translator.translate_batch(pieces, **options)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.hypotheses[0]) + 1 for r in results)
    return {"version": ctranslate2.__version__, "device": device, "compute_type": compute, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "sentences_per_s": len(results) / seconds, "output_tokens": tokens}


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cudaMemcpyAsync", "cudaMemsetAsync")  # the CUDA runtime calls that put work on the GPU
READS = ("aten::_local_scalar_dense", "aten::nonzero")  # a tensor's value read on the host: a wait for the GPU


def _host_work(check: Check, model, batch: dict, search, autocast) -> dict[str, Any]:
    """The host's work per decoder step of one search of ``batch`` (already warmed up), profiled:
    leaf aten operators (each a kernel or more on a GPU; a replayed CUDA graph runs none), CUDA
    launches (kernels, graph replays, copies; none on a CPU) and reads of a value. Steps: the longest
    output plus its EOS (the fixed shapes may run up to ``CHECK_EVERY`` - 1 more)."""
    batch = to_device(batch, check.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if check.mode.cuda else [])
    with torch.no_grad(), autocast(), profile(activities=activities) as prof:
        hyps = search(model, batch["src"], batch["src_mask"])
        sync(check.device)
    steps = max(len(t) for t in hyps.tokens) + 1
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::") and not e.cpu_children)
    launches = sum(1 for e in events if e.name in LAUNCHES)
    reads = sum(1 for e in events if e.name in READS)
    return {"steps": steps, "ops_per_step": ops / steps, "launches_per_step": launches / steps, "reads_per_step": reads / steps}

"""Training and decoding speed of the model presets, from ``scripts/conf/benchmark.yaml``.

    python scripts/benchmark.py [data=multi30k] [models=[lstm_luong,transformer]] [threads=2]

Every model is built as ``nmt/train.py`` builds it (``build_model``/``build_module`` on the train
config composed with ``model=<preset>``) and trained with ``module.loss`` and the configured
optimizer on the same batches of ``data``. Reported per model:

- training: steady-state src+tgt tokens/s (and target tokens/s) and step time (after ``train.warmup_steps``), padding
  ratio of the batches, peak memory (RSS on CPU, reset per model; ``max_memory_allocated`` on
  CUDA), and model FLOP/s against the machine's matmul peak measured in the same run (same
  dtype, same threads). Model FLOPs are counted analytically per architecture
  (``nmt.bench.flops``) on real tokens, as 3x the forward matmuls (forward + backward);
- decoding: sentences/s and output tokens/s of greedy and beam search at each batch size on the
  first ``decoding.num_sentences`` test sentences (the weights are those after the timed
  steps, so outputs tend to run to the length cap); on CPUs also beam search with the linear
  layers in int8 (``decoding.int8``, ``nmt.kernels.int8``);
- for Transformer decoders: beam search with the key/value cache vs without it, where "without"
  re-runs the decoder over the whole prefix every step (``nmt.bench.decoding.NoCache``, as Joey
  NMT decodes).

``precision``: fp32, or bf16 autocast (the default on CUDA; on a CPU with bf16 instructions it
is a faster training mode too), with the matmul peak measured in that dtype.

Results go to ``<run>/benchmark.json`` and ``<run>/benchmark.md``; the tables are also logged.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from nmt import CONF_DIR
from nmt import kernels
from nmt import register_resolvers
from nmt.bench.decoding import NoCache, decode_speed
from nmt.bench.flops import Lengths, training_flops
from nmt.bench.measure import matmul_peak, peak_memory_mb, reset_peak_memory, sync, to_device
from nmt.training.builders import build_datamodule, build_model, build_module, count_parameters
from nmt.decoding.search import beam_search, greedy_search
from nmt.kernels.malloc import keep_freed_memory
from nmt.machine import cpu_name
from nmt.models.transformer import TransformerDecoder

log = logging.getLogger(__name__)


def train_speed(module, optimizer, batches: list[dict], warmup: int, device: torch.device, autocast) -> dict[str, float]:
    """Train on ``batches``; time the steps after the first ``warmup`` ones."""
    module.train()
    times = []
    for i, batch in enumerate(batches):
        batch = to_device(batch, device)
        sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss, _ = module.loss(batch)
        loss.backward()
        optimizer.step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    timed = batches[warmup:]
    tokens = sum(b["num_src_tokens"] + b["num_tgt_tokens"] for b in timed)
    tgt_tokens = sum(b["num_tgt_tokens"] for b in timed)
    padded = sum(b["src"].numel() + b["tgt_in"].numel() for b in timed)
    return {"tokens_per_s": tokens / sum(times), "tgt_tokens_per_s": tgt_tokens / sum(times), "step_ms": 1000 * sum(times) / len(times),
            "padding": 1 - tokens / padded, "seconds": sum(times), "final_loss": float(loss.detach())}


# --- driver ----------------------------------------------------------------------------------
def train_config(cfg: DictConfig, preset: str) -> DictConfig:
    """The train config of ``model=<preset>`` with this benchmark's data and overrides, composed by a
    Hydra of its own on the package's configs: the app's finds no train.yaml as a primary config
    (Hydra looks a primary config up before it adds the search path), so it is put back after."""
    app = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            train_cfg = compose("train", overrides=[f"model={preset}", f"kernels={cfg.kernels}", *cfg.overrides])
    finally:
        GlobalHydra.instance().initialize(app)
    with open_dict(train_cfg):
        train_cfg.data = cfg.data
    return train_cfg


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Device: {report['device']}; CPU {report['cpu']}, {report['threads']} threads; matmul peak "
        f"{report['matmul_peak_gflops']:.0f} GFLOP/s ({report['dtype']}); data {report['data']} "
        f"(padding over an epoch of training batches {100 * report['epoch_padding']:.1f}%); "
        f"load average {report['load_average_start']:.1f} at the start, {report['load_average_end']:.1f} at the end.",
        "",
        "| model | params | train tok/s (src+tgt) | target tok/s | step ms | padding | peak MB | model GFLOP/s | % of peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["models"]:
        t = r["train"]
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {t['tokens_per_s']:,.0f} | {t['tgt_tokens_per_s']:,.0f} | {t['step_ms']:.0f} | "
                     f"{100 * t['padding']:.1f}% | {t['peak_mb']:,.0f} | {t['gflops']:.1f} | {100 * t['peak_fraction']:.1f}% |")
    lines += ["", "| model | search | batch | sentences/s | tokens/s |", "|---|---|---:|---:|---:|"]
    for r in report["models"]:
        for d in r["decoding"]:
            search = ("greedy" if d["beam_size"] == 1 else f"beam {d['beam_size']}") + (", int8" if d.get("int8") else "")
            lines.append(f"| {r['model']} | {search} | {d['batch_size']} | {d['sentences_per_s']:.1f} | {d['tokens_per_s']:,.0f} |")
    caches = [r for r in report["models"] if "kv_cache" in r]
    if caches:
        lines += ["", "| model | beam, batch | with cache tok/s | without tok/s | speedup | same outputs |",
                  "|---|---|---:|---:|---:|---|"]
        for r in caches:
            kv = r["kv_cache"]
            lines.append(f"| {r['model']} | {kv['beam_size']}, {kv['batch_size']} | {kv['cached']['tokens_per_s']:,.0f} | "
                         f"{kv['uncached']['tokens_per_s']:,.0f} | {kv['speedup']:.2f}x | {kv['same_outputs']} |")
    return "\n".join(lines) + "\n"


SEARCH_PATH = f"hydra.searchpath=[file://{CONF_DIR}]"  # data, paths, hydra and train.yaml: the package's configs


def main() -> None:
    register_resolvers()  # the train configs composed below use them
    sys.argv.insert(1, SEARCH_PATH)
    run()


@hydra.main(config_path="conf", config_name="benchmark", version_base="1.3")
def run(cfg: DictConfig) -> None:
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if kernels.on_cpu(cfg.kernels, device.type):
        keep_freed_memory()  # as train.py does
    if cfg.precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision must be auto, fp32 or bf16, got {cfg.precision!r}")
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    dtype = torch.bfloat16 if bf16 else torch.float32
    autocast = partial(torch.autocast, device.type, dtype=dtype) if bf16 else contextlib.nullcontext
    peak = matmul_peak(cfg.matmul_size * (4 if device.type == "cuda" else 1), device, dtype)
    log.info("matmul peak %.0f GFLOP/s (%s, %d threads)", peak / 1e9, dtype, torch.get_num_threads())

    with open_dict(cfg):
        cfg.data.max_tokens = cfg.max_tokens
    dm = build_datamodule(cfg.data)
    dm.setup()
    loader = iter(dm.train_dataloader())
    train_batches = [next(loader) for _ in range(cfg.train.warmup_steps + cfg.train.steps)]
    lengths = Lengths()
    for batch in train_batches[cfg.train.warmup_steps:]:
        lengths.add(batch)
    sources = dm.raw("test")[0][: cfg.decoding.num_sentences]
    decode_batches = {bs: list(dm.predict_loader(sources, batch_size=bs)) for bs in {*cfg.decoding.batch_sizes, cfg.kv_cache.batch_size}}

    report: dict[str, Any] = {
        "device": str(device), "threads": torch.get_num_threads(), "dtype": str(dtype).replace("torch.", ""),
        "matmul_peak_gflops": peak / 1e9, "data": HydraConfig.get().runtime.choices.get("data"),
        "torch": torch.__version__, "cpu": cpu_name(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "load_average_start": os.getloadavg()[0],
        "epoch_padding": dm.train_padding, "config": OmegaConf.to_container(cfg, resolve=True), "lengths": asdict(lengths), "models": [],
    }
    for preset in cfg.models:
        train_cfg = train_config(cfg, preset)
        torch.manual_seed(cfg.seed)
        reset_peak_memory(device)
        model = build_model(train_cfg, dm.src_vocab.vocab_size, dm.tgt_vocab.vocab_size)
        module = build_module(train_cfg, model).to(device)
        optimizer = module.configure_optimizers()
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        train = train_speed(module, optimizer, train_batches, cfg.train.warmup_steps, device, autocast)
        train["peak_mb"] = peak_memory_mb(device)
        train["gflops"] = training_flops(model, lengths) / train["seconds"] / 1e9
        train["peak_fraction"] = train["gflops"] * 1e9 / peak
        result = {"model": preset, "params": count_parameters(model), "train": train, "decoding": []}
        log.info("%s: %s", preset, {k: round(v, 3) for k, v in train.items()})

        beam = train_cfg.test_decoding  # lengths and alpha of nmt/conf/decoding/beam.yaml
        limits = {"max_len_a": beam.max_len_a, "max_len_b": beam.max_len_b}
        for bs in cfg.decoding.batch_sizes:
            for k in cfg.decoding.beam_sizes:
                search = partial(greedy_search, **limits) if k == 1 else partial(beam_search, beam_size=k, alpha=beam.alpha, **limits)
                speed, _ = decode_speed(model, decode_batches[bs], search, device, autocast)
                result["decoding"].append({"batch_size": bs, "beam_size": k, **speed})
                log.info("%s: %s batch %d: %.1f sentences/s", preset, f"beam {k}" if k > 1 else "greedy", bs, speed["sentences_per_s"])
        if cfg.decoding.int8 and device.type == "cpu":  # translate.py precision=int8
            bs, k = max(cfg.decoding.batch_sizes), max(cfg.decoding.beam_sizes)
            search = partial(beam_search, beam_size=k, alpha=beam.alpha, **limits)
            speed, _ = decode_speed(copy.deepcopy(model).quantize_int8(), decode_batches[bs], search, device, contextlib.nullcontext)
            result["decoding"].append({"batch_size": bs, "beam_size": k, "int8": True, **speed})
            log.info("%s: beam %d batch %d, int8: %.1f sentences/s", preset, k, bs, speed["sentences_per_s"])

        if isinstance(model.decoder, TransformerDecoder):
            kv = cfg.kv_cache
            search = partial(beam_search, beam_size=kv.beam_size, alpha=beam.alpha, **limits)
            batches = decode_batches[kv.batch_size][:1]
            cached, out_cached = decode_speed(model, batches, search, device, autocast)
            uncached, out_uncached = decode_speed(NoCache(model), batches, search, device, autocast)
            result["kv_cache"] = {"batch_size": kv.batch_size, "beam_size": kv.beam_size, "sentences": len(out_cached),
                                  "cached": cached, "uncached": uncached, "speedup": uncached["seconds"] / cached["seconds"],
                                  "same_outputs": out_cached == out_uncached}
            log.info("%s: key/value cache speedup %.2fx", preset, result["kv_cache"]["speedup"])
        report["models"].append(result)
        del model, module, optimizer

    report["load_average_end"] = os.getloadavg()[0]  # other processes on the CPU skew every number
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    (out_dir / "benchmark.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out_dir / "benchmark.md").write_text(table)
    log.info("results in %s\n%s", out_dir, table)


if __name__ == "__main__":
    main()

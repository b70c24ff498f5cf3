"""Activation memory and step time with and without gradient checkpointing.

    python scripts/benchmark_checkpointing.py [--model transformer] [--length 200] [--batch 32]

Builds a model preset from ``nmt/conf/model`` (tied to a vocabulary of ``--vocab``), runs
forward+backward on random batches of long sentences, and reports per setting:

- activation memory: bytes of the tensors autograd keeps for the backward pass, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (each storage once), which is what checkpointing
  saves and is the same on CPU and GPU;
- peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, the growth of the process's peak
  RSS on a CPU (coarse: the allocator keeps freed memory);
- step time (median of ``--steps`` after ``--warmup``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from nmt import CONF_DIR, register_resolvers
from nmt.bench.measure import SavedBytes
from nmt.training.builders import instantiate_model


def build(model: str, vocab: int, overrides: list[str]) -> torch.nn.Module:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"model={model}", "data=synthetic", *overrides])
    with open_dict(cfg):
        cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = vocab
        cfg.model.share_src_tgt_embeddings = False
    return instantiate_model(cfg.model)


def measure(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], enabled: bool, warmup: int, steps: int, device: torch.device) -> dict:
    model.set_gradient_checkpointing(enabled)
    model.train()
    src, src_mask, tgt_in = batch
    counter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        loss = model(src, src_mask, tgt_in).float().logsumexp(-1).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss = model(src, src_mask, tgt_in).float().logsumexp(-1).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before)
    return {"checkpointing": enabled, "activation_bytes": counter.total, "peak_bytes": peak,
            "step_seconds": statistics.median(times)}


def main() -> None:
    register_resolvers()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--length", type=int, default=200, help="source and target tokens per sentence")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the model, e.g. model.hidden_size=512")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build(args.model, args.vocab, args.overrides).to(device)
    src = torch.randint(4, args.vocab, (args.batch, args.length), device=device)
    tgt_in = torch.randint(4, args.vocab, (args.batch, args.length), device=device)
    batch = (src, torch.ones_like(src, dtype=torch.bool), tgt_in)
    # The plain run first: the CPU's peak RSS only grows, so the smaller run must not go first.
    results = [measure(model, batch, False, args.warmup, args.steps, device),
               measure(model, batch, True, args.warmup, args.steps, device)]
    plain, ckpt = results
    summary = {
        "model": args.model, "overrides": args.overrides, "device": str(device), "batch": args.batch,
        "length": args.length, "results": results,
        "activation_memory_saved": 1 - ckpt["activation_bytes"] / plain["activation_bytes"],
        "time_overhead": ckpt["step_seconds"] / plain["step_seconds"] - 1,
    }
    print(f"| checkpointing | activation MiB | peak MiB ({'GPU' if device.type == 'cuda' else 'RSS growth'}) | step s |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['checkpointing']} | {r['activation_bytes'] / 2**20:.0f} | {r['peak_bytes'] / 2**20:.0f} | {r['step_seconds']:.2f} |")
    print(f"\nactivation memory {summary['activation_memory_saved']:.0%} lower, "
          f"step time {summary['time_overhead']:+.0%} with checkpointing ({args.model}, {args.batch} x {args.length} tokens, {device})")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()

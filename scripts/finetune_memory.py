"""Peak memory and step time of fine-tuning a model of NLLB-200-distilled-600M's shape: whole,
with frozen parts (``module.freeze``) and with low-rank adapters (``module.lora``).

    OMP_NUM_THREADS=1 python scripts/finetune_memory.py [--steps 3] [--warmup 1] [--batch 8] [--length 32]

The model is nmt's Transformer as ``nmt-import`` builds it from an ``M2M100ForConditionalGeneration``
folder (``nmt.checkpoints.marian.model_config``: pre-norm, fairseq's sinusoids, one embedding
shared by encoder, decoder and output layer, the decoder starting from ``</s>``'s row and no logits
bias: ``start_from_eos``), with NLLB-200-distilled-600M's sizes:
d_model 1024, 12 + 12 layers, 16 heads, feed-forward 4096, 256,206 pieces; random weights (no
folder is read). Each configuration runs in a process of its own: the model is built, the
``TranslationModule`` applies the configuration (``nmt.training.trainable``), and Adam (the
run's optimizer, given the trained parameters only) takes ``--warmup`` + ``--steps`` steps on
batches of ``--batch`` random sentences of ``--length`` pieces on each side, through the training
loss (``TranslationModule.loss``, the CPU kernels). Reported: trained parameters, the peak RSS of
the process (``getrusage``; the weights, gradients, Adam's moments and the step's activations) and
the mean time of the measured steps (forward, backward, optimizer step) and the fastest of them
(the one least slowed by other programs on a shared machine).

Before each configuration the free memory (``MemAvailable``) must exceed an estimate of its peak
(fp32 weights, a gradient and two moments per trained weight, activations) by ``--margin`` GB;
a configuration that does not fit is skipped and recorded as such, never started.
The machine may be shared: compare the configurations by their ratios to ``whole``.
Writes ``<out>/finetune_memory.json`` and ``<out>/finetune_memory.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from nmt.machine import cpu_name

# NLLB-200-distilled-600M's config.json, as nmt.checkpoints.m2m100.read_config reads it
NLLB_600M = {"d_model": 1024, "encoder_layers": 12, "decoder_layers": 12, "encoder_attention_heads": 16,
             "decoder_attention_heads": 16, "encoder_ffn_dim": 4096, "decoder_ffn_dim": 4096,
             "max_position_embeddings": 1024, "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.0,
             "activation": "relu", "pre_norm": True, "positions": "fairseq"}
VOCAB = 256_206
LORA_TARGETS = ["q", "k", "v", "out"]
# name -> (module.freeze, module.lora)
CONFIGS = {
    "whole": ([], None),
    "freeze embeddings": (["embeddings"], None),
    "freeze embeddings + encoder": (["embeddings", "encoder"], None),
    "LoRA rank 8": ([], {"rank": 8, "alpha": 16, "dropout": 0.0, "targets": LORA_TARGETS}),
    "LoRA rank 16": ([], {"rank": 16, "alpha": 32, "dropout": 0.0, "targets": LORA_TARGETS}),
}


def rss_mb() -> float:
    """The process's resident memory now (MB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def available_gb() -> float:
    """MemAvailable of /proc/meminfo (GB)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def estimate_gb(parameters: int, trained: int, tokens: int) -> float:
    """The peak a configuration needs: fp32 weights, a gradient and Adam's two moments per trained
    weight, and about 2.5 GB of activations, output-layer buffers and the allocator's slack."""
    return (4 * parameters + 12 * trained) / 2**30 + 2.5 * tokens / 256


def build(name: str, seed: int = 0):
    """The NLLB-600M-shaped model in a ``TranslationModule`` with configuration ``name``."""
    from nmt.checkpoints.marian import model_config
    from nmt.training.builders import instantiate_model
    from nmt.training.lit_module import TranslationModule

    torch.manual_seed(seed)
    freeze, lora = CONFIGS[name]
    config = model_config(NLLB_600M, VOCAB, VOCAB, shared=True, tied=True)
    config["decoder"].update(start_from_eos=True, logits_bias=False)  # as nmt.checkpoints.m2m100 imports NLLB-200
    model = instantiate_model(config).set_kernels("auto")
    return TranslationModule(model, functools.partial(torch.optim.Adam, lr=1e-4), freeze=freeze, lora=lora)


def batch_of(rows: int, length: int, vocab: int, seed: int) -> dict:
    """Random sentences of ``length`` pieces (ids from 4: no specials but EOS and BOS where they go)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (rows, length), generator=g)
    tgt = torch.randint(4, vocab, (rows, length + 1), generator=g)
    src[:, -1], tgt[:, 0], tgt[:, -1] = 3, 2, 3  # EOS, BOS
    return {"src": src, "src_mask": src != 0, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:],
            "num_src_tokens": rows * length, "num_tgt_tokens": rows * length}


def child(name: str, steps: int, warmup: int, rows: int, length: int) -> dict:
    """One configuration, measured in this process."""
    start = time.perf_counter()
    module = build(name)
    module.train()
    optimizer = module.configure_optimizers()
    built = {"seconds": round(time.perf_counter() - start, 1), "rss_mb": round(rss_mb())}
    times = []
    for i in range(warmup + steps):
        batch = batch_of(rows, length, VOCAB, seed=i)
        begin = time.perf_counter()
        loss, _ = module.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - begin)
    states = sum(t.numel() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    return {"config": name, "freeze": CONFIGS[name][0], "lora": CONFIGS[name][1],
            "parameters": module.trainable["trained"] + module.trainable["frozen"],
            "trained": module.trainable["trained"], "adam_state_values": states, "built": built,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "step_seconds": [round(t, 2) for t in times], "mean_step_seconds": round(statistics.mean(times), 2),
            "loss": round(float(loss), 4)}


def trained_count(name: str) -> tuple[int, int]:
    """(parameters, trained) of configuration ``name``, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        module = build(name)
    return module.trainable["trained"] + module.trainable["frozen"], module.trainable["trained"]


def with_ratios(results: list[dict]) -> list[dict]:
    """Each measured configuration's peak RSS and mean step against ``whole``'s (where it ran)."""
    whole = next((r for r in results if r["config"] == "whole" and "peak_rss_mb" in r), None)
    for r in results:
        if whole and "peak_rss_mb" in r:
            r["peak_rss_vs_whole"] = round(r["peak_rss_mb"] / whole["peak_rss_mb"], 2)
            r["step_vs_whole"] = round(r["mean_step_seconds"] / whole["mean_step_seconds"], 2)
            r["fastest_step_vs_whole"] = round(min(r["step_seconds"]) / min(whole["step_seconds"]), 2)
    return results


def table(results: list[dict]) -> str:
    lines = ["| configuration | trained parameters | peak RSS | RSS vs whole | mean step | step vs whole | "
             "fastest step | fastest vs whole |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "peak_rss_mb" not in r:
            lines.append(f"| {r['config']} | {r['trained']:,} | not run: {r['skipped']} | | | | | |")
            continue
        ratios = [f"{r[key]:.2f}" if key in r else "-" for key in ("peak_rss_vs_whole", "step_vs_whole",
                                                                    "fastest_step_vs_whole")]
        lines.append(f"| {r['config']} | {r['trained']:,} ({100 * r['trained'] / r['parameters']:.2f}%) | "
                     f"{r['peak_rss_mb'] / 1024:.1f} GiB | {ratios[0]} | {r['mean_step_seconds']:.1f} s | {ratios[1]} | "
                     f"{min(r['step_seconds']):.1f} s | {ratios[2]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8, help="sentences a batch")
    parser.add_argument("--length", type=int, default=32, help="pieces a sentence, each side")
    parser.add_argument("--margin", type=float, default=3.0, help="GB of free memory left beside the estimate")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=Path("docs/results/finetune_memory"))
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(1)
        print(json.dumps(child(args.child, args.steps, args.warmup, args.batch, args.length)))
        return
    results = []
    for name in args.configs:
        parameters, trained = trained_count(name)
        need, free = estimate_gb(parameters, trained, args.batch * args.length), available_gb()
        if free < need + args.margin:
            print(f"{name}: skipped, about {need:.1f} GB needed and {free:.1f} GB free (margin {args.margin} GB)",
                  file=sys.stderr)
            results.append({"config": name, "parameters": parameters, "trained": trained,
                            "skipped": f"about {need:.0f} GB needed, {free:.0f} GB free"})
            continue
        print(f"{name}: about {need:.1f} GB needed, {free:.1f} GB free", file=sys.stderr)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(args.steps),
                               "--warmup", str(args.warmup), "--batch", str(args.batch), "--length", str(args.length)],
                              env=env, capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["free_gb_before"] = round(free, 1)
        print(json.dumps(result), file=sys.stderr)
        results.append(result)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(["OMP_NUM_THREADS=1 python scripts/finetune_memory.py", *sys.argv[1:]]),
              "model": {**NLLB_600M, "vocab_size": VOCAB, "shared_embeddings": True},
              "batch": {"sentences": args.batch, "length": args.length}, "steps": args.steps, "warmup": args.warmup,
              "threads": 1, "cpu": cpu_name(), "torch": torch.__version__, "results": with_ratios(results)}
    (args.out / "finetune_memory.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / "finetune_memory.md").write_text(
        f"`{record['command']}`: a model of NLLB-200-distilled-600M's shape, random weights, Adam; batches of "
        f"{args.batch} x {args.length} pieces; mean of {args.steps} steps after {args.warmup}; one thread.\n\n"
        + table(results))
    print(table(results))


if __name__ == "__main__":
    main()

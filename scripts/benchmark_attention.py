"""The cost curve of the self-attention patterns: time of one attention layer and one encoder
layer (hidden 256, 4 heads, feed-forward 1,024; one sentence), forward and forward+backward, for
n from 16 to 4,096 tokens, per pattern (``nmt.bench.attention_cost.VARIANTS``), with the fitted
exponent of time in n, the crossover length against full attention, and memory at 1,024 and 4,096
tokens: the bytes saved for backward, and the peak resident memory of a forward+backward pass,
each measured in a fresh process (on a CPU; ``torch.cuda.max_memory_allocated`` on a GPU).

    python scripts/benchmark_attention.py [--device cpu|cuda] [--lengths 16,32,...] [--repeats 3] \
        [--out docs/results/attention_cost]

Writes ``<out>.json`` (every row) and ``<out>.md`` (the tables), and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


import torch

from nmt.bench.attention_cost import FIT_FROM, LENGTHS, VARIANTS, layer_for, measure, summary


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_child(variant: str, n: int) -> None:
    """In a fresh process: the resident-memory peak of one forward+backward pass (Linux's VmHWM,
    reset just before it) above the resident memory before it (the layer and the input built, one
    short pass run)."""
    layer = layer_for(variant, 256, 4, 1024, max(n, 64), torch.device("cpu"))
    short = torch.randn(1, 16, 256, requires_grad=True)
    layer(short, torch.ones(1, 1, 1, 16, dtype=torch.bool)).sum().backward()
    x = torch.randn(1, n, 256, requires_grad=True)
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current size
    before = _status_kb("VmRSS")
    layer(x, torch.ones(1, 1, 1, n, dtype=torch.bool)).sum().backward()
    print((_status_kb("VmHWM") - before) / 1024)


def markdown(rows: list[dict], table: dict[str, dict], device: str, threads: int) -> str:
    lengths = sorted({r["n"] for r in rows})
    at = {(r["variant"], r["n"]): r for r in rows}
    out = [f"# Attention patterns: cost against length ({device}, {threads} threads)", "",
           "`python scripts/benchmark_attention.py`: one sentence, hidden 256, 4 heads, feed-forward 1,024, fp32; "
           "best of the repeats after a warm-up.", "",
           "## Summary", "",
           f"| pattern | options | claimed | exponent, attention (n >= {FIT_FROM}) | exponent, layer | faster than full from n = (attention) | (layer) "
           "| saved for backward MB at 1,024 / 4,096 | peak MB at 1,024 / 4,096 |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
    for variant, s in table.items():
        options = ", ".join(f"{k}={v}" for k, v in s["options"].items()) or "-"
        out.append(f"| {variant} | {options} | {s['claimed']} | {fmt(s['exponent_attention'])} | {fmt(s['exponent_layer'])} "
                   f"| {fmt(s['crossover_attention'], '{}') if variant != 'full' else '-'} | {fmt(s['crossover_layer'], '{}') if variant != 'full' else '-'} "
                   f"| {fmt(s.get('saved_mb_1024'), '{:.1f}')} / {fmt(s.get('saved_mb_4096'), '{:.1f}')} "
                   f"| {fmt(s.get('peak_mb_1024'), '{:.0f}')} / {fmt(s.get('peak_mb_4096'), '{:.0f}')} |")
    for key, title in (("attention_backward_s", "Attention layer, forward+backward, ms"), ("attention_forward_s", "Attention layer, forward, ms"),
                       ("layer_backward_s", "Encoder layer, forward+backward, ms"), ("layer_forward_s", "Encoder layer, forward, ms")):
        out += ["", f"## {title}", "", "| pattern | " + " | ".join(str(n) for n in lengths) + " |",
                "|---|" + "---:|" * len(lengths)]
        for variant in table:
            cells = []
            for n in lengths:
                r = at.get((variant, n))
                ratio = "" if variant == "full" or r is None else f" ({at[('full', n)][key] / r[key]:.1f}x)"
                cells.append("-" if r is None else f"{1000 * r[key]:.2f}{ratio}")
            out.append(f"| {variant} | " + " | ".join(cells) + " |")
    out += ["", "(x): the pattern's speed-up over full attention at that length."]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="writes <out>.json and <out>.md")
    parser.add_argument("--peak-child", nargs=2, metavar=("VARIANT", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_child:
        peak_child(args.peak_child[0], int(args.peak_child[1]))
        return
    device = torch.device(args.device)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    for variant in VARIANTS:
        for n in lengths:
            row = measure(variant, n, device, repeats=args.repeats)
            if device.type == "cpu" and n in (1024, 4096):
                child = subprocess.run([sys.executable, __file__, "--peak-child", variant, str(n)],
                                       capture_output=True, text=True, check=True)
                row["layer_peak_mb"] = float(child.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{variant:13s} n={n:5d}  attention {1000 * row['attention_forward_s']:9.2f} / {1000 * row['attention_backward_s']:9.2f} ms"
                  f"  layer {1000 * row['layer_forward_s']:9.2f} / {1000 * row['layer_backward_s']:9.2f} ms"
                  f"  saved {row['layer_saved_mb']:8.1f} MB" + (f"  peak {row['layer_peak_mb']:.0f} MB" if "layer_peak_mb" in row else ""),
                  flush=True)
    table = summary(rows)
    threads = torch.get_num_threads()
    print(json.dumps(table, indent=1))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": str(device), "threads": threads, "torch": torch.__version__, "lengths": lengths, "repeats": args.repeats}
        out.with_suffix(".json").write_text(json.dumps({**meta, "summary": table, "rows": rows}, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(rows, table, str(device), threads))


if __name__ == "__main__":
    main()

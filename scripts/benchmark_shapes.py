"""Batch shapes per epoch and the padding they cost: exact padding against shape buckets
(``data.shapes=buckets``, ``nmt/data/shapes.py``), on real corpora.

    NMT_DATA_DIR=../shared/data python scripts/benchmark_shapes.py data=multi30k
    NMT_DATA_DIR=../shared/data python scripts/benchmark_shapes.py data=europarl_it_en --max-tokens 2048 8192 25000

For each ``max_tokens``: one training epoch of the data config's training pairs cut by
``TokenBatchSampler`` both ways: batches, distinct (rows, source length, target length) shapes,
the padded fraction of the tokens, and the padded tokens the buckets add over exact padding (the
extra work a compiled step must repay). Other Hydra overrides go to the train config (``data.*``).
Writes ``<out>/<data>.json`` and ``.md`` (default out: docs/results/shapes).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir

from nmt import CONF_DIR, register_resolvers
from nmt.data.batching import TokenBatchSampler
from nmt.data.shapes import ShapeBuckets, bucket
from nmt.training.builders import build_datamodule

ROOT = Path(__file__).resolve().parents[1]


def epoch_shapes(lengths: np.ndarray, max_tokens: int, buckets: bool, seed: int) -> dict[str, float]:
    sampler = TokenBatchSampler(lengths, max_tokens, seed=seed, shapes=ShapeBuckets(max_tokens) if buckets else None)
    shapes = sampler.shapes_of_epoch(0)
    real, padded = sampler.token_counts(0)
    out = {"batches": len(shapes), "shapes": len(np.unique(shapes, axis=0)), "padding": round(1 - real / padded, 4),
           "padded_tokens": padded, "real_tokens": real}
    if buckets:  # the alternative: the same batches with each side padded to its own bucket
        order, bounds, _ = sampler.epoch_arrays(0)
        sides = np.stack([bucket(np.maximum.reduceat(lengths[order, k].astype(np.int64), bounds[:-1])) for k in (0, 1)], 1)
        per_side = np.concatenate([shapes[:, :1], sides], 1)
        out.update(per_side_shapes=len(np.unique(per_side, axis=0)),
                   per_side_padded_tokens=int((per_side[:, :1] * per_side[:, 1:]).sum()))
    return out


def markdown(data: str, pairs: int, rows: list[dict]) -> str:
    lines = [f"# Batch shapes per epoch: `data={data}`", "",
             f"`python scripts/benchmark_shapes.py data={data}`: one epoch of {pairs:,} training pairs cut into token "
             "batches; shapes are (rows, source length, target length) as `collate` pads them.", "",
             "| max_tokens | batches exact | buckets | shapes exact | buckets | padding exact | buckets "
             "| tokens added by buckets | shapes, each side its own bucket | tokens added |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        e, b = r["exact"], r["buckets"]
        added, per_side = b["padded_tokens"] / e["padded_tokens"] - 1, b["per_side_padded_tokens"] / e["padded_tokens"] - 1
        lines.append(f"| {r['max_tokens']:,} | {e['batches']:,} | {b['batches']:,} | {e['shapes']:,} | {b['shapes']:,} | "
                     f"{100 * e['padding']:.1f}% | {100 * b['padding']:.1f}% | {100 * added:+.1f}% | "
                     f"{b['per_side_shapes']:,} | {100 * per_side:+.1f}% |")
    lines += ["", "`data.shapes=buckets` pads both sides to one length (the bucket of the longer side); the last two "
              "columns show the alternative of padding each side to its own bucket, on the same batches."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="train config overrides (data=..., data.*)")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=None, help="default: the data config's, 8192, 25000")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "shapes")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    register_resolvers()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["hydra.runtime.output_dir=.", *args.overrides], return_hydra_config=True)
    from hydra.core.hydra_config import HydraConfig
    HydraConfig().set_config(cfg)
    datamodule = build_datamodule(cfg.data)
    datamodule.setup()
    lengths = datamodule.datasets["train"].lengths()
    data = cfg.hydra.runtime.choices.data
    rows = []
    for max_tokens in args.max_tokens or [int(cfg.data.max_tokens), 8192, 25000]:
        row = {"max_tokens": max_tokens, **{kind: epoch_shapes(lengths, max_tokens, kind == "buckets", cfg.seed)
                                           for kind in ("exact", "buckets")}}
        row["buckets"]["tokens_added"] = round(row["buckets"]["padded_tokens"] / row["exact"]["padded_tokens"] - 1, 4)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"data": data, "pairs": len(lengths), "rows": rows, "command": f"python scripts/benchmark_shapes.py {' '.join(args.overrides)}"}
    (args.out / f"{data}.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(data, len(lengths), rows)
    (args.out / f"{data}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

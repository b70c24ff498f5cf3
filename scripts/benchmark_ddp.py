"""Training throughput on a multi-core CPU: one process using every core's thread, against
data-parallel processes (DDP over gloo), one per core with one thread each, at the same update
size (each of N ranks draws batches of max_tokens / N tokens).

    python scripts/benchmark_ddp.py data=multi30k                       # the four presets, bf16
    python scripts/benchmark_ddp.py --models lstm_luong --cores 2 --steps 200 data=multi30k

Both modes run ``train.py`` for ``--steps`` updates without validation and read the training
tokens/s (source + target, all ranks) from each run's ``summary.json``. Writes
``benchmark_ddp.json`` and ``benchmark_ddp.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["lstm", "lstm_bahdanau", "lstm_luong", "transformer"]
log = logging.getLogger("benchmark_ddp")


def run(model: str, mode: str, args: argparse.Namespace, overrides: list[str]) -> dict:
    out = args.out / f"{model}_{mode}"
    command = [sys.executable, str(ROOT / "train.py"), f"model={model}", f"trainer.max_steps={args.steps}",
               "test=false", "trainer.num_sanity_val_steps=0", "trainer.val_check_interval=1000000",
               "trainer.check_val_every_n_epoch=null", "trainer.max_time=null", "callbacks.rich_progress_bar=null",
               "trainer.enable_progress_bar=false", f"trainer.precision={args.precision}", f"hydra.run.dir={out}"]
    env = dict(os.environ)
    if mode == "ddp":
        command += ["trainer=ddp", "trainer.accelerator=cpu", f"trainer.devices={args.cores}",
                    f"data.max_tokens={args.max_tokens // args.cores}"]
        env["OMP_NUM_THREADS"] = "1"
    else:
        command += [f"data.max_tokens={args.max_tokens}"]
        env["OMP_NUM_THREADS"] = str(args.cores)
    log.info("%s", " ".join(command[1:] + overrides))
    subprocess.run(command + overrides, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    return {"tokens_per_sec": summary["train_tokens_per_sec"], "steps": summary["steps"],
            "processes": summary["hardware"]["devices"], "threads": summary["hardware"]["cpu_threads"]}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=3000, help="tokens per update, over all ranks")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmark_ddp")
    args, overrides = parser.parse_known_args()
    results = []
    for model in args.models:
        single, ddp = (run(model, mode, args, overrides) for mode in ("single", "ddp"))
        results.append({"model": model, "single": single, "ddp": ddp, "speedup": ddp["tokens_per_sec"] / single["tokens_per_sec"]})
        log.info("%s: one process %.0f tokens/s, %d processes %.0f (%.2fx)", model, single["tokens_per_sec"],
                 ddp["processes"], ddp["tokens_per_sec"], results[-1]["speedup"])
    report = {"cores": args.cores, "steps": args.steps, "max_tokens": args.max_tokens, "precision": args.precision,
              "overrides": overrides, "load_average_end": os.getloadavg()[0], "results": results}
    lines = [f"{args.cores} cores, {args.precision}, {args.max_tokens} tokens per update, {args.steps} updates; "
             f"overrides: {' '.join(overrides) or 'none'}", "",
             f"| model | 1 process x {args.cores} threads: tok/s | {args.cores} processes x 1 thread (DDP): tok/s | speedup |",
             "|---|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['single']['tokens_per_sec']:,.0f} | {r['ddp']['tokens_per_sec']:,.0f} | {r['speedup']:.2f}x |"
              for r in results]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmark_ddp.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "benchmark_ddp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

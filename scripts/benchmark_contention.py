"""Training throughput on a quiet and on a busy CPU, side by side in one run.

    python scripts/benchmark_contention.py [--model transformer] [--steps 120] [--rounds 1]
        [--settings default passive one_thread] [--out docs/results/benchmark_cpu/contention.json]

For each setting (environment variables and overrides of the training process), ``train.py`` trains
``--steps`` steps of the preset twice: alone, and beside one competing CPU-bound process
(``yes > /dev/null``, as a second job on a developer's machine would be). It reports the target
tokens per second of each (``summary.json``'s ``train_tgt_tokens_per_sec``, which counts training
steps only) and the busy/quiet ratio. A fair share of a 2-core machine with one competitor is
half of it; the busy figure should stay well above what the quiet run gets from one core.
Rounds alternate quiet and busy runs, so a drift of the machine's speed hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name: (environment variables, train.py overrides) of the training process
SETTINGS = {
    "default": ({}, []),
    "fixed_threads": ({}, ["callbacks.cpu_threads=null"]),  # without the callback that adapts the thread count
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),  # OpenMP threads sleep at barriers instead of spinning
    "one_thread": ({"OMP_NUM_THREADS": "1"}, []),
    "spin_10k": ({"GOMP_SPINCOUNT": "10000"}, []),  # GNU OpenMP: spin this long at a barrier, then sleep (default 300k)
}
OVERRIDES = ["trainer.max_epochs=-1", "trainer.val_check_interval=null", "trainer.check_val_every_n_epoch=100000",
             "test=false", "callbacks.model_checkpoint=null", "callbacks.rich_progress_bar=null", "trainer.max_time=null"]


def train_once(model: str, steps: int, setting: tuple[dict[str, str], list[str]], busy: bool, work: Path) -> float:
    """Target tokens/s of one training run of ``steps`` steps, beside a competitor if ``busy``."""
    env, overrides = setting
    run = Path(tempfile.mkdtemp(dir=work))
    command = [sys.executable, "train.py", f"model={model}", f"trainer.max_steps={steps}", *OVERRIDES, *overrides,
               f"hydra.run.dir={run}"]
    competitor = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if busy else None
    try:
        result = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    if result.returncode != 0:
        raise SystemExit(f"training failed ({' '.join(command)}):\n{result.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    return float(summary["train_tgt_tokens_per_sec"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", type=Path, help="write the table as JSON here too")
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {s: {"quiet": [], "busy": []} for s in args.settings}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            for setting in args.settings:
                for busy in ((False, True) if r % 2 == 0 else (True, False)):
                    rate = train_once(args.model, args.steps, SETTINGS[setting], busy, Path(work))
                    results[setting]["busy" if busy else "quiet"].append(rate)
                    print(f"round {r + 1} {setting} {'busy' if busy else 'quiet'}: {rate:,.0f} target tokens/s",
                          flush=True)
    quiet_default = statistics.median(results[args.settings[0]]["quiet"])
    print(f"\n| setting | quiet tokens/s | busy tokens/s | busy / quiet | quiet / quiet {args.settings[0]} |")
    print("|---|---:|---:|---:|---:|")
    table = {}
    for setting, rates in results.items():
        quiet, busy = statistics.median(rates["quiet"]), statistics.median(rates["busy"])
        table[setting] = {"env": SETTINGS[setting][0], "overrides": SETTINGS[setting][1], "quiet": quiet, "busy": busy, "busy_over_quiet": busy / quiet,
                          "quiet_over_default": quiet / quiet_default, "runs": rates}
        print(f"| {setting} | {quiet:,.0f} | {busy:,.0f} | {busy / quiet:.2f} | {quiet / quiet_default:.2f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "steps": args.steps, "rounds": args.rounds,
                                        "cpu_count": os.cpu_count(), "settings": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()

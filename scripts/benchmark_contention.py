"""Training throughput on a quiet and on a busy CPU, side by side in one run.

    python scripts/benchmark_contention.py [--model transformer] [--steps 120] [--rounds 1]
        [--settings default passive one_thread] [--intermittent 3] [--out docs/results/benchmark_cpu/contention.json]

For each setting (environment variables and overrides of the training process), ``train.py`` trains
``--steps`` steps of the preset twice: alone, and beside one competing CPU-bound process
(``yes > /dev/null``, as a second job on a developer's machine would be). It reports the target
tokens per second of each (``summary.json``'s ``train_tgt_tokens_per_sec``, which counts training
steps only) and the busy/quiet ratio. A fair share of a 2-core machine with one competitor is
half of it; the busy figure should stay well above what the quiet run gets from one core.
Rounds alternate quiet and busy runs, so a drift of the machine's speed hits both alike.
``--intermittent S``: the competitor runs S seconds, pauses S seconds, and so on; each run also
reports how often ``nmt.training.cpu_threads`` logged a change of the thread count and its summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
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


class Competitor:
    """One ``yes > /dev/null`` beside the training run: all along, or (``period`` seconds) running
    for a period, then stopped for one, and so on."""

    def __init__(self, period: float | None = None) -> None:
        self.period, self.proc, self.done = period, None, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _start(self) -> None:
        self.proc = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _run(self) -> None:
        while not self.done.is_set():
            self._start()
            if self.done.wait(self.period):
                break
            self._stop()
            self.done.wait(self.period)

    def __enter__(self) -> "Competitor":
        self._start() if self.period is None else self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.period is not None:
            self.thread.join()
        self._stop()


def train_once(model: str, steps: int, setting: tuple[dict[str, str], list[str]], busy: bool, work: Path,
               period: float | None = None) -> dict:
    """One training run of ``steps`` steps, beside a competitor if ``busy`` (one that comes and
    goes every ``period`` seconds if given): target tokens/s, and the thread-count changes of
    ``nmt.training.cpu_threads`` (INFO lines of the log, and the summary's ``cpu_threads``)."""
    env, overrides = setting
    run = Path(tempfile.mkdtemp(dir=work))
    command = [sys.executable, "train.py", f"model={model}", f"trainer.max_steps={steps}", *OVERRIDES, *overrides,
               f"hydra.run.dir={run}"]
    with (Competitor(period) if busy else contextlib.nullcontext()):
        result = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"training failed ({' '.join(command)}):\n{result.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    log = (run / "train.log").read_text() if (run / "train.log").is_file() else ""
    return {"rate": float(summary["train_tgt_tokens_per_sec"]),
            "thread_lines": sum("running on" in line and "thread" in line for line in log.splitlines()),
            "cpu_threads": summary.get("cpu_threads")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", type=Path, help="write the table as JSON here too")
    parser.add_argument("--intermittent", type=float, metavar="SECONDS",
                        help="the busy runs' competitor comes and goes every this many seconds")
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {s: {"quiet": [], "busy": []} for s in args.settings}
    changes: dict[str, list[dict]] = {s: [] for s in args.settings}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            for setting in args.settings:
                for busy in ((False, True) if r % 2 == 0 else (True, False)):
                    one = train_once(args.model, args.steps, SETTINGS[setting], busy, Path(work), args.intermittent)
                    rate = one["rate"]
                    results[setting]["busy" if busy else "quiet"].append(rate)
                    changes[setting].append(one)
                    print(f"round {r + 1} {setting} {'busy' if busy else 'quiet'}: {rate:,.0f} target tokens/s, "
                          f"{one['thread_lines']} thread-count log line(s), cpu_threads {one['cpu_threads']}",
                          flush=True)
    quiet_default = statistics.median(results[args.settings[0]]["quiet"])
    print(f"\n| setting | quiet tokens/s | busy tokens/s | busy / quiet | quiet / quiet {args.settings[0]} |")
    print("|---|---:|---:|---:|---:|")
    table = {}
    for setting, rates in results.items():
        quiet, busy = statistics.median(rates["quiet"]), statistics.median(rates["busy"])
        table[setting] = {"env": SETTINGS[setting][0], "overrides": SETTINGS[setting][1], "quiet": quiet, "busy": busy, "busy_over_quiet": busy / quiet,
                          "quiet_over_default": quiet / quiet_default, "runs": rates, "threads": changes[setting]}
        print(f"| {setting} | {quiet:,.0f} | {busy:,.0f} | {busy / quiet:.2f} | {quiet / quiet_default:.2f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "steps": args.steps, "rounds": args.rounds,
                                        "intermittent": args.intermittent,
                                        "cpu_count": os.cpu_count(), "settings": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()

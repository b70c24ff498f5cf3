"""Translation side by side with CTranslate2 on the same weights: whole commands, alternating
rounds, wall time, peak resident memory and BLEU of each.

    python scripts/compare_ctranslate2.py --ckpt <run>/checkpoints/last.ckpt --src test.de --ref test.en \\
        [--rounds 3 --threads 2 --out docs/results/benchmark_cpu]

Exports the checkpoint to CTranslate2 (int8 weights) under ``--work``, then runs, in turn each
round: ``translate.py precision=int8`` (2,048 and 1,024 source tokens per batch),
``translate.py precision=bf16`` and ``scripts/translate_ctranslate2.py --compute-type int8`` (beam 5
and the run's length limits for all; CTranslate2 with one thread per batch and ``--threads``
batches at once, its fastest setting on 2 cores, as ``translate.py``'s workers), each a fresh
process whose peak resident memory comes from ``wait4``. Writes
``compare_ctranslate2.{json,md}`` into ``--out``: medians over the rounds and the ratio of each
to CTranslate2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import sacrebleu

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(cmd: list[str], out: Path, env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and peak resident MiB of one command, its stdout written to ``out``."""
    start = time.perf_counter()
    with out.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.DEVNULL, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (status {status})")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, type=Path)
    parser.add_argument("--src", required=True, type=Path)
    parser.add_argument("--ref", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("outputs/compare_ctranslate2"))
    parser.add_argument("--out", type=Path, default=ROOT / "docs/results/benchmark_cpu")
    args = parser.parse_args()

    from nmt import register_resolvers
    from nmt.checkpoint import load_checkpoint
    from nmt.export_ctranslate2 import to_ctranslate2

    register_resolvers()  # checkpoint configs may use them

    args.work.mkdir(parents=True, exist_ok=True)
    ct2 = args.work / "ct2_int8"
    if not ct2.is_dir():
        loaded = load_checkpoint(args.ckpt)
        to_ctranslate2(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, ct2, quantization="int8")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    ours = [sys.executable, "translate.py", f"ckpt={args.ckpt.resolve()}", f"input={args.src.resolve()}",
            "decoding.beam_size=5", f"hydra.run.dir={args.work.resolve() / 'hydra'}"]
    systems = {
        "nmt int8": [*ours, "precision=int8"],
        "nmt int8 max_tokens=1024": [*ours, "precision=int8", "max_tokens=1024"],
        "nmt bf16": [*ours, "precision=bf16"],
        "CTranslate2 int8": [sys.executable, "scripts/translate_ctranslate2.py", str(ct2.resolve()),
                             "-i", str(args.src.resolve()), "--beam-size", "5", "--compute-type", "int8",
                             "--inter-threads", str(args.threads), "--intra-threads", "1"],
    }
    refs = args.ref.read_text(encoding="utf-8").splitlines()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    bleu: dict[str, float] = {}
    for round_ in range(args.rounds):
        for name, cmd in systems.items():
            out = args.work / f"{name.replace(' ', '_').replace('=', '')}.txt"
            runs[name].append(timed(cmd, out, env))
            hyps = out.read_text(encoding="utf-8").splitlines()
            bleu[name] = round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
            print(f"round {round_ + 1} {name}: {runs[name][-1][0]:.2f} s, {runs[name][-1][1]:.0f} MiB, BLEU {bleu[name]}",
                  flush=True)
    medians = {name: {"seconds": statistics.median(s for s, _ in r), "peak_mib": statistics.median(m for _, m in r),
                      "bleu": bleu[name], "runs": r} for name, r in runs.items()}
    base = medians["CTranslate2 int8"]
    lines = ["| command | seconds | x CTranslate2 | peak MiB | x CTranslate2 | BLEU |", "|---|---:|---:|---:|---:|---:|"]
    for name, m in medians.items():
        lines.append(f"| {name} | {m['seconds']:.2f} | {m['seconds'] / base['seconds']:.2f} | {m['peak_mib']:.0f} | "
                     f"{m['peak_mib'] / base['peak_mib']:.2f} | {m['bleu']:.2f} |")
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare_ctranslate2.json").write_text(json.dumps(
        {"ckpt": str(args.ckpt), "src": str(args.src), "threads": args.threads, "rounds": args.rounds,
         "systems": {n: systems[n] for n in systems}, "results": medians}, indent=2) + "\n")
    (args.out / "compare_ctranslate2.md").write_text(
        f"Beam 5, {args.src.name}, {args.threads} threads, medians of {args.rounds} alternating rounds, whole commands.\n\n"
        + table)
    print(table)


if __name__ == "__main__":
    main()

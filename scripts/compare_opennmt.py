"""Training speed side by side with OpenNMT-py, same data, sizes, batch and machine, runs
alternating so that the machine's drift hits both toolkits alike:

    python scripts/compare_opennmt.py --onmt-bin /path/to/opennmt-venv/bin [--steps 100 --rounds 2]

OpenNMT-py (3.5; in a virtual environment of its own, it pins an older torch) trains on the
pieces of this project's SentencePiece model for the data config (``data=multi30k`` by default),
with the vocabulary shared as ours is, 3,000-token batches and the presets' sizes: LSTM with
``general`` attention and input feeding for ``lstm_luong``, with ``mlp`` (additive) attention for
``lstm_bahdanau``, and the Transformer for ``transformer``. Both read target tokens/s from their own
logs: OpenNMT-py's report lines after ``--warmup`` steps, ``train.py``'s ``summary.json`` (the first
step excluded). Writes ``compare_opennmt.json`` and ``compare_opennmt.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
from pathlib import Path

from nmt import register_resolvers
from nmt.bench.opennmt import ONMT_MODELS, onmt_config, onmt_speed
from nmt.bench.toolkits import our_speed, vocab_config, write_pieces

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("compare_opennmt")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    register_resolvers()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--onmt-bin", type=Path, required=True, help="bin/ of the environment with OpenNMT-py")
    parser.add_argument("--models", nargs="+", default=list(ONMT_MODELS), choices=list(ONMT_MODELS))
    parser.add_argument("--precisions", nargs="+", default=["32", "bf16-mixed"], help="ours; OpenNMT-py trains in fp32 on CPUs")
    parser.add_argument("--data", default="multi30k")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10, help="OpenNMT-py steps left out (reports come every 10)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "compare_opennmt")
    args = parser.parse_args()
    if not (args.onmt_bin / "onmt_train").is_file():
        parser.error(f"--onmt-bin {args.onmt_bin}: no onmt_train there; pip install OpenNMT-py==3.5.1 into an environment of its own")
    work = args.out / "opennmt"
    work.mkdir(parents=True, exist_ok=True)
    paths = write_pieces(args.data, work)
    subprocess.run([str(args.onmt_bin / "onmt_build_vocab"), "-config", str(vocab_config(work, paths))], check=True,
                   capture_output=True)

    speeds: dict[str, dict[str, list[float]]] = {m: {"opennmt-py": [], **{p: [] for p in args.precisions}} for m in args.models}
    for round_ in range(args.rounds):
        for model in args.models:
            config = onmt_config(model, paths, work, args.steps)
            speeds[model]["opennmt-py"].append(onmt_speed(args.onmt_bin, config, args.warmup, args.threads))
            for precision in args.precisions:
                out = args.out / f"{model}_{precision}_{round_}"
                speeds[model][precision].append(our_speed(model, args.steps, precision, args.data, out, args.threads))
            log.info("round %d %s: %s", round_ + 1, model, {k: round(v[-1]) for k, v in speeds[model].items()})

    report = {"data": args.data, "steps": args.steps, "rounds": args.rounds, "threads": args.threads, "speeds": speeds}
    lines = [f"Target tokens/s, {args.data}, 3,000-token batches, {args.steps} steps, {args.threads} threads; median of "
             f"{args.rounds} alternating rounds (all runs in compare_opennmt.json)", "",
             "| model | OpenNMT-py (fp32) | " + " | ".join(f"ours {p}" for p in args.precisions) + " | "
             + " | ".join(f"{p} / OpenNMT-py" for p in args.precisions) + " |",
             "|---|" + "---:|" * (1 + 2 * len(args.precisions))]
    for model, by in speeds.items():
        onmt = statistics.median(by["opennmt-py"])
        ours = [statistics.median(by[p]) for p in args.precisions]
        lines.append(f"| {model} | {onmt:,.0f} | " + " | ".join(f"{v:,.0f}" for v in ours) + " | "
                     + " | ".join(f"{v / onmt:.2f}x" for v in ours) + " |")
    (args.out / "compare_opennmt.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "compare_opennmt.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Lexically constrained decoding on the synthetic test set, constraints drawn from the references:

    python scripts/constraints_benchmark.py --ckpt transformer=<a.ckpt> --ckpt lstm_bahdanau=<b.ckpt> \\
        [--pairs 300] [--words 2] [--rounds 2] [--out docs/results/constraints]

For each test pair, ``--words`` words of its reference (drawn with a fixed seed, each a
constraint of its own) must appear in the translation. Each model translates the pairs with beam
``--beam`` (5), without and with the constraints (``Translator.translate(constraints=...)``), in alternating
rounds in this process. Reported: the share of constraints the output holds (as whole words),
BLEU without and with, and the median seconds of each. Writes ``constraints.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import sacrebleu

from nmt import register_resolvers
from nmt.evaluate import load_test_split
from nmt.inference.translator import Translator


def satisfied(outputs: list[str], constraints: list[list[str]]) -> float:
    """Percent of the constraints whose words appear, in order and whole, in their output."""
    hit = total = 0
    for out, phrases in zip(outputs, constraints):
        padded = f" {out} "
        for phrase in phrases:
            total += 1
            hit += f" {phrase} " in padded
    return 100.0 * hit / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", action="append", required=True, help="name=path, once per model")
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--words", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("docs/results/constraints"))
    args = parser.parse_args()
    register_resolvers()
    rows = {}
    for spec in args.ckpt:
        name, _, path = spec.partition("=")
        translator = Translator.load(path, device="cpu", precision="32", decoding={"_target_": "nmt.decoding.search.beam_search",
                                                                  "beam_size": args.beam, "alpha": 0.6})
        sources, refs, _ = load_test_split({**translator.run_config["data"], "cache_dir": ".cache"}, path)
        sources, refs = sources[: args.pairs], refs[: args.pairs]
        rng = random.Random(0)
        constraints = [rng.sample(r.split(), min(args.words, len(r.split()))) for r in refs]
        times: dict[str, list[float]] = {"free": [], "constrained": []}
        outputs: dict[str, list[str]] = {}
        for _ in range(args.rounds):
            for kind in times:
                start = time.perf_counter()
                done = translator.translate(sources, constraints=constraints if kind == "constrained" else None)
                times[kind].append(time.perf_counter() - start)
                outputs[kind] = [t.text for t in done]
        rows[name] = {
            "pairs": len(sources), "constraints": sum(map(len, constraints)),
            "satisfied_free": satisfied(outputs["free"], constraints),
            "satisfied_constrained": satisfied(outputs["constrained"], constraints),
            "bleu_free": sacrebleu.corpus_bleu(outputs["free"], [refs]).score,
            "bleu_constrained": sacrebleu.corpus_bleu(outputs["constrained"], [refs]).score,
            "seconds_free": statistics.median(times["free"]), "seconds_constrained": statistics.median(times["constrained"]),
        }
        print(name, rows[name], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "constraints.json").write_text(json.dumps({"words": args.words, "beam": args.beam, "rows": rows}, indent=2) + "\n")
    lines = ["| model | constraints | held, free | held, constrained | BLEU free | BLEU constrained | s free | s constrained | x |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['constraints']} | {r['satisfied_free']:.1f}% | {r['satisfied_constrained']:.1f}% | "
                     f"{r['bleu_free']:.1f} | {r['bleu_constrained']:.1f} | {r['seconds_free']:.1f} | "
                     f"{r['seconds_constrained']:.1f} | {r['seconds_constrained'] / r['seconds_free']:.1f} |")
    (args.out / "constraints.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Time translate.py's modes on one test set, in one process, alternating rounds:

    python scripts/benchmark_translate_modes.py --ckpt <ckpt> --src test.de --ref test.en [--rounds 3]

beam-5 one-best, beam-5 with a 5-best list, greedy, sampling, and scoring the references
(``mode=score``), each through the functions ``translate.py`` runs (start-up excluded), with
``--precision`` and torch's thread count. Prints a markdown table: median seconds and the ratio
to beam-5 one-best.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

from nmt import register_resolvers
from nmt.decoding.search import beam_search, greedy_search, sample_search
from nmt.inference.translator import Translator
from nmt.text_lines import read_lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--src", required=True, type=Path)
    parser.add_argument("--ref", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="32")
    args = parser.parse_args()
    register_resolvers()  # checkpoint configs may use them
    translator = Translator.load(args.ckpt, device="cpu", precision=args.precision)
    sources = read_lines(args.src)
    refs = read_lines(args.ref)
    limits = {"max_len_a": 1.5, "max_len_b": 10}
    searches = {
        "beam 5": partial(beam_search, beam_size=5, alpha=0.6, **limits),
        "beam 5, 5-best list": partial(beam_search, beam_size=5, alpha=0.6, nbest=5, **limits),
        "greedy": partial(greedy_search, **limits),
        "sampling": partial(sample_search, **limits),
    }

    def run(name: str) -> None:
        if name == "score references":
            translator.score(sources, refs)
            return
        translator.translate(sources, search=searches[name])

    names = [*searches, "score references"]
    times: dict[str, list[float]] = {n: [] for n in names}
    run("beam 5")  # warm-up
    for _ in range(args.rounds):
        for name in names:
            start = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["beam 5"])
    print(f"{len(sources)} sentences, precision {args.precision}, medians of {args.rounds} alternating rounds\n")
    print("| mode | seconds | x beam 5 |\n|---|---:|---:|")
    for name in names:
        m = statistics.median(times[name])
        print(f"| {name} | {m:.2f} | {m / base:.2f} |")


if __name__ == "__main__":
    main()

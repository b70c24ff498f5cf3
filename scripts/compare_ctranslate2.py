"""Translation with the CTranslate2 backend against CTranslate2 called directly and against the
torch backend in each decoding precision, on the same weights: whole commands, alternating rounds,
wall time, peak resident memory, BLEU, and the precision each command chose.

    python scripts/compare_ctranslate2.py --ckpt <run>/checkpoints/last.ckpt --src test.de --ref test.en \\
        [--rounds 3 --threads 2 --isa AVX2 --out docs/results/benchmark_cpu]

Exports the checkpoint to CTranslate2 (int8 weights) under ``--work``, then runs, in turn each
round, each a fresh process whose peak resident memory comes from ``wait4``:
``translate.py ckpt=<folder>`` (the CTranslate2 backend), ``translate.py ckpt=<ckpt>`` with
``precision=auto`` (the default), ``32``, ``bf16`` and ``int8`` (the torch backend), and this
script's ``--direct`` mode: the few lines a CTranslate2 user writes (SentencePiece, one
``translate_batch`` over the whole input, the same beam, length penalty and cap). All use beam 5
and ``--threads`` batches at once, one thread each (CTranslate2's fastest setting on 2 cores, as
``translate.py``'s workers). ``--isa AVX2`` runs every command as on a CPU without bf16 and VNNI
(``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY`` and ``CT2_FORCE_CPU_ISA`` capped there: the
matmul libraries and the precision probes of ``nmt.machine`` then see that CPU). Writes
``compare_ctranslate2[_<isa>].{json,md}`` into ``--out``: medians over the rounds and the ratio of
each to CTranslate2 direct.
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

from nmt.text_lines import read_lines

ROOT = Path(__file__).resolve().parents[1]


def direct(folder: Path, src: Path, threads: int) -> None:
    """CTranslate2 on its own: what the benchmark compares the backend with."""
    import ctranslate2
    import sentencepiece as spm

    meta = json.loads((folder / "nmt_export.json").read_text())
    src_sp = spm.SentencePieceProcessor(model_file=str(folder / "source.model"))
    tgt_sp = spm.SentencePieceProcessor(model_file=str(folder / "target.model"))
    translator = ctranslate2.Translator(str(folder), device="cpu", inter_threads=threads, intra_threads=1)
    lines = read_lines(src)
    sources = [[src_sp.id_to_piece(i) for i in ids][: meta["max_src_len"] - 1] for ids in src_sp.encode(lines)]
    n = sum(len(s) + 1 for s in sources) / max(len(sources), 1)
    longest = max(len(s) for s in sources) + 1
    results = translator.translate_batch(sources, beam_size=5, length_penalty=0.6 * n / (5 + n),
                                         max_decoding_length=int(1.5 * longest + 10) - 1, min_decoding_length=0,
                                         max_batch_size=2048, batch_type="tokens")
    sys.stdout.write("".join(tgt_sp.decode([tgt_sp.piece_to_id(p) for p in r.hypotheses[0]]) + "\n" for r in results))


def timed(cmd: list[str], out: Path, env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and peak resident MiB of one command, its stdout written to ``out`` and its
    stderr to ``out`` with the suffix ``.log``."""
    start = time.perf_counter()
    with out.open("w") as f, out.with_suffix(".log").open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (status {status})")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--direct", type=Path, help="translate --src with this CTranslate2 folder directly and exit")
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--src", required=True, type=Path)
    parser.add_argument("--ref", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("outputs/compare_ctranslate2"))
    parser.add_argument("--out", type=Path, default=ROOT / "docs/results/benchmark_cpu")
    parser.add_argument("--isa", choices=["AVX2"], help="run as on a CPU of this instruction set (no bf16, no VNNI)")
    args = parser.parse_args()
    if args.direct is not None:
        return direct(args.direct, args.src, args.threads)
    if args.ckpt is None or args.ref is None:
        parser.error("--ckpt and --ref are needed (or --direct FOLDER)")

    from nmt import register_resolvers
    from nmt.checkpoints.loading import load_checkpoint
    from nmt.exporters.ctranslate2 import to_ctranslate2

    register_resolvers()  # checkpoint configs may use them

    args.work.mkdir(parents=True, exist_ok=True)
    ct2 = args.work / "ct2_int8"
    if not ct2.is_dir():
        loaded = load_checkpoint(args.ckpt)
        to_ctranslate2(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, ct2, quantization="int8")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if args.isa:
        env |= {"ONEDNN_MAX_CPU_ISA": args.isa, "ATEN_CPU_CAPABILITY": args.isa.lower(), "CT2_FORCE_CPU_ISA": args.isa}
    common = [f"input={args.src.resolve()}", f"workers={args.threads}", f"hydra.run.dir={args.work.resolve() / 'hydra'}"]
    torch_backend = [sys.executable, "translate.py", f"ckpt={args.ckpt.resolve()}", *common]
    systems = {
        "translate.py, CTranslate2 backend": [sys.executable, "translate.py", f"ckpt={ct2.resolve()}", *common,
                                              "ctranslate2.intra_threads=1"],
        "CTranslate2 direct": [sys.executable, "scripts/compare_ctranslate2.py", "--direct", str(ct2.resolve()),
                               "--src", str(args.src.resolve()), "--threads", str(args.threads)],
        **{f"translate.py, torch backend, precision={p}": [*torch_backend, f"precision={p}"]
           for p in ("auto", "32", "bf16", "int8")},
    }
    refs = read_lines(args.ref)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    bleu: dict[str, float] = {}
    chosen: dict[str, str] = {}
    for round_ in range(args.rounds):
        for name, cmd in systems.items():
            out = args.work / f"{name.replace(' ', '_').replace('=', '')}.txt"
            runs[name].append(timed(cmd, out, env))
            hyps = read_lines(out)
            bleu[name] = round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
            chosen[name] = chosen_precision(out.with_suffix(".log").read_text(encoding="utf-8", errors="replace"),
                                            cmd)
            print(f"round {round_ + 1} {name}: {runs[name][-1][0]:.2f} s, {runs[name][-1][1]:.0f} MiB, BLEU {bleu[name]}"
                  f", ran in {chosen[name]}", flush=True)
    medians = {name: {"seconds": statistics.median(s for s, _ in r), "peak_mib": statistics.median(m for _, m in r),
                      "bleu": bleu[name], "precision": chosen[name], "runs": r} for name, r in runs.items()}
    base = medians["CTranslate2 direct"]
    lines = ["| command | ran in | seconds | x CTranslate2 direct | peak MiB | x CTranslate2 direct | BLEU |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, m in medians.items():
        lines.append(f"| {name} | {m['precision']} | {m['seconds']:.2f} | {m['seconds'] / base['seconds']:.2f} | "
                     f"{m['peak_mib']:.0f} | {m['peak_mib'] / base['peak_mib']:.2f} | {m['bleu']:.2f} |")
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "compare_ctranslate2" + (f"_{args.isa.lower()}" if args.isa else "")
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"ckpt": str(args.ckpt), "src": str(args.src), "threads": args.threads, "rounds": args.rounds,
         "isa": args.isa, "systems": {n: systems[n] for n in systems}, "results": medians}, indent=2) + "\n")
    cpu = f"as a CPU without bf16 and VNNI ({args.isa} caps), " if args.isa else ""
    (args.out / f"{stem}.md").write_text(
        f"Beam 5, {args.src.name}, {args.threads} threads, {cpu}medians of {args.rounds} alternating rounds, "
        f"whole commands.\n\n" + table)
    print(table)


def chosen_precision(log: str, cmd: list[str]) -> str:
    """The precision a command decoded in: what ``precision=auto`` logged, else the one it gave
    (``slow`` added where it was warned about), or the CTranslate2 folder's int8."""
    import re

    found = re.search(r"precision=auto: (\w+)", log)
    given = next((a.split("=", 1)[1] for a in cmd if a.startswith("precision=")), None)
    name = found[1] if found else given or "int8 (CTranslate2)"
    return name + (", warned slow" if "runs slowly" in log else "")


if __name__ == "__main__":
    main()

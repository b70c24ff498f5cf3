"""Translate a text file (or stdin) with a folder written by ``nmt.export_ctranslate2.to_ctranslate2``.

    python scripts/translate_ctranslate2.py EXPORT_DIR [-i in.txt] [-o out.txt] [--beam-size 5]
        [--compute-type default] [--inter-threads 1] [--intra-threads 0] [--batch-tokens 2048]

Needs only ``ctranslate2`` and ``sentencepiece``. One output line per input line; empty (or
blank) lines stay empty. Sources are SentencePiece pieces of the folder's ``source.model``,
truncated to the model's ``max_src_len`` (EOS included, which CTranslate2 appends), as
``nmt.translate`` does. The defaults of ``--beam-size``, ``--length-penalty``, ``--max-len-a``
and ``--max-len-b`` are the run's test decoding, saved in the folder's ``nmt_export.json``.

How this differs from ``nmt.decoding`` (``conf/decoding/beam.yaml``):

- Length cap: ours allows ``int(max_len_a * source_length + max_len_b)`` decoder steps (source
  length with EOS), the last one forced to EOS. CTranslate2 takes one ``max_decoding_length``
  per call, so sentences are grouped by their cap and each group gets ``cap - 1`` steps, which
  gives the same tokens: at the cap CTranslate2 stops instead of forcing EOS.
  ``min_decoding_length`` is 0, as ours (CTranslate2's default 1 forbids an empty output).
- Length penalty: ours is GNMT's ``((5 + |Y|) / 6) ** alpha`` with |Y| counting EOS;
  CTranslate2 divides by ``|Y| ** length_penalty`` with |Y| without EOS. The default
  ``length_penalty`` is ``alpha * n / (5 + n)``, n the mean source length: the two penalties then
  grow alike around that length (Multi30k test2016, beam 5: 937 of 1,000 lines as ours, against
  902 with ``length_penalty = alpha``). Beam outputs can still differ; greedy (``--beam-size 1``)
  gives the same tokens (tests/test_export_ctranslate2.py).
- Stopping: ours stops a sentence once ``beam_size`` hypotheses ended or none of the live ones
  can still win; CTranslate2 once ``beam_size * patience`` hypotheses ended.
- Scores: PAD and BOS get a -inf bias in the exported output layer, so CTranslate2's
  probabilities are renormalised over the other tokens (ours keep the softmax over all of them);
  the best token at each step is the same.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("translate_ctranslate2")


def read_lines(path: str | None) -> list[str]:
    """Lines of a UTF-8 file (stdin when ``path`` is None), without their newline."""
    text = (sys.stdin.buffer.read() if path is None else Path(path).read_bytes()).decode("utf-8")
    lines = text.split("\n")  # not splitlines(): it also splits at form feeds, U+2028, ...
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def decoding_cap(num_pieces: int, max_len_a: float, max_len_b: int, max_tgt_len: int) -> int:
    """CTranslate2's ``max_decoding_length`` for a source of ``num_pieces`` pieces (EOS not
    counted): ``nmt.decoding``'s step cap ``int(a * (pieces + 1) + b)`` (at least 1) minus the
    forced-EOS step, within the decoder's position table."""
    steps = max(int(max_len_a * (num_pieces + 1) + max_len_b), 1)
    return min(steps - 1, max_tgt_len)


def translate_pieces(translator, sources: list[list[str]], meta: dict, beam_size: int, length_penalty: float,
                     max_len_a: float, max_len_b: int, batch_tokens: int, one_cap: bool = False) -> list[list[str]]:
    """Target pieces for each source (lists of pieces, EOS not included): one asynchronous
    ``translate_batch`` per length cap, each batched by tokens inside CTranslate2; ``one_cap``:
    a single call with the largest cap (CTranslate2's own batching over all sentences; only
    outputs that reach their own cap can differ)."""
    limit = int(meta["max_src_len"]) - 1  # room for EOS
    truncated = sum(len(s) > limit for s in sources)
    if truncated:
        log.warning("truncated %d source(s) longer than %d pieces", truncated, limit)
    sources = [s[:limit] for s in sources]
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(sources):
        groups.setdefault(decoding_cap(len(s), max_len_a, max_len_b, int(meta["max_tgt_len"])), []).append(i)
    if one_cap and groups:
        groups = {max(groups): [i for rows in groups.values() for i in rows]}
    out: list[list[str]] = [[] for _ in sources]
    pending = []
    for cap, rows in groups.items():
        if cap <= 0:  # only the forced EOS fits
            continue
        results = translator.translate_batch(
            [sources[i] for i in rows], beam_size=beam_size, length_penalty=length_penalty,
            max_decoding_length=cap, min_decoding_length=0, max_input_length=0,
            max_batch_size=batch_tokens, batch_type="tokens", asynchronous=True,
        )
        pending.append((rows, results))
    for rows, results in pending:
        for i, result in zip(rows, results):
            out[i] = result.result().hypotheses[0]
    return out


def gnmt_slope(alpha: float, sources: list[list[str]]) -> float:
    """CTranslate2's length penalty closest to GNMT's ``((5 + n) / 6) ** alpha``: the exponent p of
    ``n ** p`` with the same slope in log space (``alpha * n / (5 + n)``) at the mean source
    length, a stand-in for the output length."""
    n = sum(len(s) + 1 for s in sources) / max(len(sources), 1)
    return alpha * n / (5 + n)


def translate_lines(folder: str | Path, lines: list[str], beam_size: int | None = None, length_penalty: float | None = None,
                    max_len_a: float | None = None, max_len_b: int | None = None, batch_tokens: int = 2048,
                    compute_type: str = "default", inter_threads: int = 1, intra_threads: int = 0,
                    one_cap: bool = False) -> list[str]:
    """One detokenized translation per line ("" for a blank line); None takes the export's defaults."""
    import ctranslate2
    import sentencepiece as spm

    folder = Path(folder)
    meta = json.loads((folder / "nmt_export.json").read_text())
    defaults = meta["decoding"]
    src_sp = spm.SentencePieceProcessor(model_file=str(folder / "source.model"))
    tgt_sp = spm.SentencePieceProcessor(model_file=str(folder / "target.model"))
    translator = ctranslate2.Translator(str(folder), device="cpu", compute_type=compute_type,
                                        inter_threads=inter_threads, intra_threads=intra_threads)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    # Ids mapped to pieces, so an unknown character is "<unk>" (as our UNK id), not its surface form.
    sources = [[src_sp.id_to_piece(i) for i in ids] for ids in src_sp.encode([lines[i] for i in todo])]
    pieces = translate_pieces(
        translator, sources, meta,
        beam_size=defaults["beam_size"] if beam_size is None else beam_size,
        length_penalty=gnmt_slope(defaults["alpha"], sources) if length_penalty is None else length_penalty,
        max_len_a=defaults["max_len_a"] if max_len_a is None else max_len_a,
        max_len_b=defaults["max_len_b"] if max_len_b is None else max_len_b,
        batch_tokens=batch_tokens, one_cap=one_cap,
    )
    outputs = [""] * len(lines)
    for i, hyp in zip(todo, pieces):
        outputs[i] = tgt_sp.decode([tgt_sp.piece_to_id(p) for p in hyp])
    return outputs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a folder written by nmt.export_ctranslate2.to_ctranslate2")
    parser.add_argument("-i", "--input", default=None, help="input file (default: stdin)")
    parser.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    parser.add_argument("--beam-size", type=int, default=None, help="1: greedy (default: the export's)")
    parser.add_argument("--length-penalty", type=float, default=None,
                        help="CTranslate2's: score / length ** this (default: the export's GNMT alpha * n / (5 + n), "
                             "n the mean source length: the same slope as GNMT's penalty there)")
    parser.add_argument("--max-len-a", type=float, default=None, help="cap a * source_length + b (default: the export's)")
    parser.add_argument("--max-len-b", type=int, default=None, help="(default: the export's)")
    parser.add_argument("--compute-type", default="default", help="default (the saved weights' type), int8, int8_float32, bfloat16, float32, ...")
    parser.add_argument("--inter-threads", type=int, default=1, help="batches translated at once (default: 1)")
    parser.add_argument("--intra-threads", type=int, default=0, help="threads per batch (0: CTranslate2's default)")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="source tokens per batch (default: 2048)")
    parser.add_argument("--one-cap", action="store_true",
                        help="one call with the largest length cap: faster, same output unless a sentence reaches its cap")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    lines = read_lines(args.input)
    outputs = translate_lines(args.folder, lines, args.beam_size, args.length_penalty, args.max_len_a, args.max_len_b,
                              args.batch_tokens, args.compute_type, args.inter_threads, args.intra_threads, args.one_cap)
    text = "".join(line + "\n" for line in outputs)
    if args.output is None:
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
    log.info("translated %d lines (%d blank)", len(lines), len(lines) - sum(bool(l.strip()) for l in lines))


if __name__ == "__main__":
    main()

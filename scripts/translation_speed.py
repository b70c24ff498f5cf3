"""Parameters and translation time of several models on the same sentences, one CPU thread each.

    python scripts/translation_speed.py --input $NMT_DATA_DIR/multi30k/test_2016_flickr.de \
        --model teacher=<run>/checkpoints/last.ckpt --model student=<run>/checkpoints/last.ckpt \
        [--lines 1000] [--beam 5] [--model-beam student=1] [--out speed.json] [--src-lang deu_Latn --tgt-lang fra_Latn]

For each model, on the first ``--lines`` input lines: its parameter count, and the seconds to
translate them with beam search (``--beam``, or ``--model-beam NAME=K`` for one model: 1 is greedy
search; the run's own length penalty) on one thread:
the torch backend in fp32 (``Translator``, batches of 2,048 source tokens), and, when
``ctranslate2`` is installed and the model exports, CTranslate2 with int8 weights (exported into a
temporary folder). Each timing is the best of ``--repeats`` runs, after one warm-up batch.
A model that reads the source language and writes the target's first (an imported M2M100,
NLLB-200 or mBART-50, or a run fine-tuned from one) translates with ``--src-lang`` and
``--tgt-lang``, its codes; the other models ignore them.
Prints and writes the numbers as JSON, with each one's ratio to the first model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path



def best_of(repeats: int, work) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--model", action="append", required=True, help="name=checkpoint")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--model-beam", action="append", default=[], help="name=K: this model's beam size (1: greedy)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--src-lang", default=None, help="the source language's code, for models that read it")
    parser.add_argument("--tgt-lang", default=None, help="the target language's code, for models that read both")
    args = parser.parse_args()

    import torch

    from nmt.checkpoints.loading import load_checkpoint
    from nmt.inference.translator import Translator
    from nmt.text_lines import read_lines

    names = [spec.partition("=")[0] for spec in args.model]
    beams = {}
    for spec in args.model_beam:
        name, _, k = spec.partition("=")
        if name not in names or not k.isdigit() or int(k) < 1:
            parser.error(f"--model-beam {spec}: expected NAME=K with NAME one of {', '.join(names)} and K >= 1")
        beams[name] = int(k)
    torch.set_num_threads(1)
    lines = read_lines(Path(args.input), strip=True)[: args.lines]
    results: dict[str, dict] = {}
    for spec in args.model:
        name, _, path = spec.partition("=")
        loaded = load_checkpoint(path)
        alpha = (loaded.run_config.get("test_decoding") or {}).get("alpha")
        beam = beams.get(name, args.beam)
        decoding = ({"_target_": "nmt.decoding.search.greedy_search"} if beam == 1 else
                    {"_target_": "nmt.decoding.search.beam_search", "beam_size": beam, "alpha": alpha})
        translator = Translator.load(path, device="cpu", precision="32", decoding=decoding, max_tokens=2048, workers=1)
        languages = {"src_lang": args.src_lang, "tgt_lang": args.tgt_lang} if translator.decoder_languages else {}
        translator.translate(lines[:16], **languages)  # warm-up
        row = {"ckpt": path, "beam": beam, "parameters": sum(p.numel() for p in {id(p): p for p in loaded.model.parameters()}.values()),
               "torch_fp32_s": round(best_of(args.repeats, lambda: translator.translate(lines, **languages)), 2)}
        try:
            from nmt.exporters.ctranslate2 import to_ctranslate2
            from nmt.inference.ctranslate2 import CTranslate2Translator
        except ModuleNotFoundError:
            to_ctranslate2 = None
        if to_ctranslate2 is not None:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    folder = to_ctranslate2(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config,
                                            Path(tmp) / "ct2", quantization="int8")
                except ValueError as e:
                    row["ctranslate2_int8_s"] = f"not exported: {e}"
                else:
                    ct2 = CTranslate2Translator(folder, decoding, device="cpu", max_tokens=2048, workers=1,
                                                intra_threads=1)
                    ct2.translate(lines[:16], **languages)
                    row["ctranslate2_int8_s"] = round(best_of(args.repeats, lambda: ct2.translate(lines, **languages)), 2)
        results[name] = row
        print(name, row, flush=True)
    first = next(iter(results.values()))
    for row in results.values():
        for key in ("torch_fp32_s", "ctranslate2_int8_s"):
            if isinstance(row.get(key), float) and isinstance(first.get(key), float):
                row[f"{key}_speedup_vs_first"] = round(first[key] / row[key], 2)
    text = json.dumps({"lines": len(lines), "beam": args.beam, "threads": 1, "models": results}, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

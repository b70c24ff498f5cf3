"""A checkpoint against its Hugging Face export on real sentences: the same greedy outputs?

    python scripts/compare_huggingface.py --ckpt <run>/checkpoints/last.ckpt \
        --input $NMT_DATA_DIR/multi30k/test_2016_flickr.de --ref $NMT_DATA_DIR/multi30k/test_2016_flickr.en \
        [--lines 1000] [--out results.json]

Exports the checkpoint with ``nmt-export format=huggingface`` into a temporary folder, then on
the first ``--lines`` input lines, one thread each, in batches of 32 sentences:

- the largest difference between the two models' teacher-forced logits on the first batch
  (decoder inputs: our greedy outputs);
- greedy search: ours (``nmt.decoding.search.greedy_search``, a step cap of 256) and
  ``generate(num_beams=1, max_new_tokens=255)``, the share of identical outputs, the BLEU of
  each against ``--ref``, and each one's translation time.

Prints and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


BATCH = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import sacrebleu
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from nmt.checkpoints.loading import load_checkpoint
    from nmt.data.tokenizer import BOS
    from nmt.decoding.search import greedy_search
    from nmt.export import export
    from nmt.inference.translator import encode_sources, pad
    from nmt.text_lines import read_lines

    torch.set_num_threads(1)
    lines = read_lines(Path(args.input), strip=True)[: args.lines]
    refs = read_lines(Path(args.ref), strip=True)[: args.lines]
    loaded = load_checkpoint(args.ckpt)
    model = loaded.model.eval()
    with tempfile.TemporaryDirectory() as tmp:
        folder = export(OmegaConf.create({"ckpt": args.ckpt, "format": "huggingface", "out": f"{tmp}/hf",
                                          "weights": "stored", "allow_pickle": False}))
        hf, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
        kind = type(hf).__name__
    ours, theirs, seconds, logit_diff = [], [], {"nmt": 0.0, "transformers": 0.0}, None
    with torch.no_grad():
        for start in range(0, len(lines), BATCH):
            chunk = lines[start : start + BATCH]
            begin = time.perf_counter()
            src, src_mask = pad(encode_sources(chunk, loaded.src_vocab, 1024), torch.device("cpu"))
            tokens = greedy_search(model, src, src_mask, max_len_a=0, max_len_b=256).tokens
            ours += [loaded.tgt_vocab.decode(t) for t in tokens]
            seconds["nmt"] += time.perf_counter() - begin
            begin = time.perf_counter()
            batch = tokenizer(chunk, return_tensors="pt", padding=True)
            out = hf.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=255)
            theirs += tokenizer.batch_decode(out, skip_special_tokens=True)
            seconds["transformers"] += time.perf_counter() - begin
            if logit_diff is None:
                width = min(len(t) for t in tokens) + 1
                tgt_in = torch.tensor([[BOS, *t[: width - 1]] for t in tokens])
                a = model(src, src_mask, tgt_in)[..., : loaded.tgt_vocab.vocab_size]
                b = hf(**batch, decoder_input_ids=tgt_in).logits
                logit_diff = float((a - b).abs().max())
    same = sum(a == b for a, b in zip(ours, theirs))
    result = {
        "ckpt": args.ckpt, "class": kind, "lines": len(lines), "max_logit_difference": logit_diff,
        "identical_greedy_outputs": same, "identical_share": round(same / len(lines), 4),
        "bleu": {"nmt": round(sacrebleu.corpus_bleu(ours, [refs]).score, 2),
                 "transformers": round(sacrebleu.corpus_bleu(theirs, [refs]).score, 2)},
        "seconds_one_thread": {k: round(v, 1) for k, v in seconds.items()},
        "differing": [{"line": i + 1, "nmt": a, "transformers": b}
                      for i, (a, b) in enumerate(zip(ours, theirs)) if a != b][:5],
    }
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

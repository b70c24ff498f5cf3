"""Alignment error rate of attention models on the synthetic test set, whose gold alignments the
generator knows (``nmt.data.synthetic.gold_alignment``: one-to-one, every word):

    python scripts/alignment_error.py --ckpt bahdanau=<a.ckpt> --ckpt transformer=<b.ckpt> \\
        [--pairs 1000] [--out docs/results/alignments]

Each checkpoint's own test split (its data config, ``data=synthetic``) is force-aligned: the
references teacher-forced, each target subword aligned to the source subword its attention weighs
most, lifted to words (``nmt.inference.alignments``), as ``decoding.alignments=true`` does for translations.
For a Transformer every decoder layer (averaged over heads) is scored too, beside the layer the
model aligns with (``Seq2Seq.alignment_attention``). Writes ``alignment_error.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nmt import register_resolvers
from nmt.inference.alignments import aer, parse, pharaoh
from nmt.data.synthetic import gold_alignment
from nmt.data.tokenizer import BOS
from nmt.evaluate import load_test_split
from nmt.inference.translator import Translator, encode_sources, pad


def layer_alignments(translator: Translator, sources: list[str], targets: list[str], batch: int = 64) -> dict[str, list[str]]:
    """Pharaoh alignments of the pairs from every decoder layer and from the model's own choice."""
    out: dict[str, list[str]] = {}
    src_ids = encode_sources(sources, translator.src_vocab, translator.max_src_len)
    tgt_ids = [ids[:-1] for ids in encode_sources(targets, translator.tgt_vocab, translator.max_tgt_len)]
    for start in range(0, len(sources), batch):
        s_ids, t_ids = src_ids[start : start + batch], tgt_ids[start : start + batch]
        out.setdefault("model", []).extend(translator.alignments(s_ids, t_ids))
        src, src_mask = pad(s_ids, translator.device)
        tgt_in, _ = pad([[BOS, *t] for t in t_ids], translator.device)
        with torch.inference_mode():
            weights = translator.model.cross_attention(src, src_mask, tgt_in)  # (B, layers, heads, T, S)
        if weights is None or weights.size(1) == 1:
            continue
        for layer in range(weights.size(1)):
            mean = weights[:, layer].mean(1).float()
            out.setdefault(f"layer {layer + 1}", []).extend(
                pharaoh(translator.src_vocab.pieces(s[:-1]), translator.tgt_vocab.pieces(t), mean[i, : len(t), : len(s) - 1].tolist())
                for i, (s, t) in enumerate(zip(s_ids, t_ids)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", action="append", required=True, help="name=path, once per model")
    parser.add_argument("--pairs", type=int, default=1000, help="the first N test pairs")
    parser.add_argument("--out", type=Path, default=Path("docs/results/alignments"))
    args = parser.parse_args()
    register_resolvers()
    results: dict[str, dict[str, float]] = {}
    for spec in args.ckpt:
        name, _, path = spec.partition("=")
        translator = Translator.load(path, device="cpu", precision="32")
        data = translator.run_config["data"]
        if "SyntheticSource" not in str(data.get("source", {}).get("_target_", "")):
            raise SystemExit(f"{path}: trained on {data.get('source', {}).get('_target_')}; gold alignments exist for "
                             "the synthetic data only")
        sources, refs, _ = load_test_split({**data, "cache_dir": ".cache"}, str(path))
        sources, refs = sources[: args.pairs], refs[: args.pairs]
        gold = [parse(gold_alignment(s)) for s in sources]
        found = layer_alignments(translator, sources, refs)
        results[name] = {key: round(100 * aer([parse(a) for a in links], gold), 2) for key, links in found.items()}
        print(name, results[name], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alignment_error.json").write_text(json.dumps({"pairs": args.pairs, "aer_percent": results}, indent=2) + "\n")
    columns = sorted({k for r in results.values() for k in r}, key=lambda k: (k != "model", k))
    lines = ["| model | " + " | ".join(f"AER % ({c})" for c in columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {name} | " + " | ".join(f"{r[c]:.1f}" if c in r else "" for c in columns) + " |" for name, r in results.items()]
    (args.out / "alignment_error.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Corpus-level BLEU and chrF with sacreBLEU, on detokenized hypotheses and raw references."""

from __future__ import annotations

from typing import Any

from sacrebleu.metrics import BLEU, CHRF


def corpus_scores(hyps: list[str], refs: list[str], tokenize: str | None = None) -> dict[str, Any]:
    """BLEU and chrF of a whole corpus (never an average of sentence scores), with signatures.

    ``tokenize`` is sacreBLEU's tokenizer (default ``13a``; ``zh`` for Chinese output)."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    bleu = BLEU(tokenize=tokenize) if tokenize else BLEU()
    chrf = CHRF()
    b = bleu.corpus_score(hyps, [refs])
    c = chrf.corpus_score(hyps, [refs])
    return {
        "bleu": b.score,
        "chrf": c.score,
        "length_ratio": b.sys_len / b.ref_len if b.ref_len else 0.0,  # hypothesis / reference words (13a)
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }

"""Lexically constrained decoding on the synthetic test set, constraints drawn from the references:

    python scripts/constraints_benchmark.py --ckpt transformer=<a.ckpt> [--ckpt lstm_bahdanau=<b.ckpt>] \\
        [--pairs 300] [--words 2] [--rounds 2] [--beam 5] [--batch 32] [--precision auto] [--out docs/results/constraints]

For each test pair, ``--words`` words of its reference (drawn with a fixed seed, each a
constraint of its own) must appear in the translation. Each model translates the pairs ``--batch``
at a time with beam ``--beam`` (5): without the constraints, with them through the batched search
(``nmt.decoding.constrained``), and with them one sentence at a time (``sentence_at_a_time``
below: the search before it was batched, kept here as the baseline and as the tests' reference),
all through ``Translator.translate`` at ``--precision`` (the translator's default, ``auto``: bf16
where the CPU computes it in hardware), in alternating rounds in this process. Reported: the share of
constraints each output holds (as whole words), BLEU, the median seconds of each, the batched
search's speed-up over one sentence at a time, and the share of sentences both constrained
searches translate alike. Writes ``constraints.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import sacrebleu
import torch
from torch import Tensor

from nmt import register_resolvers
from nmt.decoding.constrained import check_constraints
from nmt.decoding.scoring import Hypotheses, length_penalty, log_probs, max_lengths
from nmt.evaluate import load_test_split
from nmt.inference import translator as translator_module
from nmt.inference.translator import Translator
from nmt.models.base import select
from nmt.specials import BOS, EOS

log = logging.getLogger(__name__)
Phrase = tuple[int, ...]


@dataclass(frozen=True)
class Progress:
    """Which constraints a hypothesis has met, and (constraint, tokens written) of the one it is inside."""

    met: frozenset[int] = frozenset()
    inside: tuple[int, int] | None = None
    just_met: bool = False  # the last token ended a constraint: the next must start a word

    def tokens_met(self, constraints: list[Phrase]) -> int:
        return sum(len(constraints[c]) for c in self.met) + (self.inside[1] if self.inside else 0)

    def after(self, token: int, constraints: list[Phrase]) -> Progress:
        if self.inside is not None:
            c, done = self.inside
            if constraints[c][done] == token:
                return self._advanced(c, done + 1, constraints)
        # not continuing the constraint it was inside (if any): start one whose first token this is
        for c, phrase in enumerate(constraints):
            if c not in self.met and phrase[0] == token:
                return Progress(self.met)._advanced(c, 1, constraints)
        return Progress(self.met)

    def _advanced(self, c: int, done: int, constraints: list[Phrase]) -> Progress:
        if done == len(constraints[c]):
            return Progress(self.met | {c}, None, True)
        return Progress(self.met, (c, done))

    def wanted(self, constraints: list[Phrase]) -> set[int]:
        """The tokens that make progress: the next of the constraint it is inside, else the first
        of each constraint not met."""
        if self.inside is not None:
            c, done = self.inside
            return {constraints[c][done]}
        return {phrase[0] for c, phrase in enumerate(constraints) if c not in self.met}


def _allocate(banks: list[int], k: int) -> list[int]:
    """Indices of the ``k`` candidates kept, candidates given best first with their bank: each bank
    gets k // (banks) places (the highest banks the remainder), places a bank cannot fill go to
    the best of the rest."""
    levels = sorted(set(banks))
    size, extra = divmod(k, len(levels))
    quota = {level: size + (1 if i >= len(levels) - extra else 0) for i, level in enumerate(levels)}
    kept, rest = [], []
    for i, level in enumerate(banks):
        if quota[level] > 0:
            quota[level] -= 1
            kept.append(i)
        else:
            rest.append(i)
    return sorted(kept + rest[: k - len(kept)])


@torch.no_grad()
def sentence_at_a_time(model, src: Tensor, src_mask: Tensor, constraints: list[list[Phrase]], beam_size: int = 5,
                       alpha: float = 0.6, max_len_a: float = 1.5, max_len_b: int = 10,
                       need_attn: bool = False, nbest: int = 1, continuation: Tensor | None = None) -> Hypotheses:
    """``nmt.decoding.constrained.constrained_beam_search`` (same arguments, same hypotheses where
    no two phrases of a sentence share a token), one sentence at a time, with Python objects per
    hypothesis: a constraint is tracked from its first token on, and a token that breaks it off
    loses the progress (a phrase that overlaps itself, "a a b" inside "a a a b", is missed)."""
    caps = max_lengths(src_mask, max_len_a, max_len_b)
    results = []
    for i in range(src.size(0)):
        cons = [tuple(int(t) for t in p) for p in constraints[i]]
        check_constraints(cons, int(caps[i]))
        length = int(src_mask[i].sum())
        ranked, _ = _one(model, src[i : i + 1, :length], src_mask[i : i + 1, :length], cons, beam_size, alpha,
                         int(caps[i]), nbest, continuation)
        results.append(ranked)
    best = [r[0][0] for r in results]
    nbest_out = [[(t, s) for t, s in r] for r in results] if nbest > 1 else None
    return Hypotheses(best, torch.tensor([r[0][1] for r in results]), None, nbest_out)


def _one(model, src: Tensor, src_mask: Tensor, constraints: list[Phrase], k: int, alpha: float, cap: int,
         nbest: int, continuation: Tensor | None) -> tuple[list[tuple[list[int], float]], float]:
    """The ``nbest`` best (tokens, score) of one sentence, best first."""
    device = src.device
    memory = model.encode(src, src_mask)
    state = select(model.init_state(memory), torch.zeros(1, dtype=torch.long, device=device))
    prev = torch.tensor([BOS], device=device)
    beams: list[tuple[list[int], float, Progress]] = [([], 0.0, Progress())]
    ended: list[tuple[float, list[int]]] = []
    for t in range(cap):
        logits, state, _ = model.decode_step(prev, memory, state)
        x = log_probs(logits, model.tgt_vocab_size, model.kernels)  # (beams, W)
        width = x.size(1)
        total = torch.tensor([b[1] for b in beams], device=device).unsqueeze(1) + x
        open_ = torch.tensor([len(b[2].met) < len(constraints) for b in beams], device=device)
        total[:, EOS] = total[:, EOS].masked_fill(open_, float("-inf"))  # EOS only once every constraint is met
        if continuation is not None:  # a constraint just met ends its word
            for b, (_, _, progress) in enumerate(beams):
                if progress.just_met:
                    total[b, : continuation.numel()] = total[b, : continuation.numel()].masked_fill(continuation, float("-inf"))
        if t == cap - 1:  # at the cap only EOS may follow
            total[:, :EOS] = float("-inf")
            total[:, EOS + 1 :] = float("-inf")
        picks = set(total.view(-1).topk(min(k, total.numel())).indices.tolist())
        picks |= {b * width + int(total[b].argmax()) for b in range(len(beams))}
        for b, (_, _, progress) in enumerate(beams):
            picks |= {b * width + w for w in progress.wanted(constraints)}
        candidates = []
        for flat in picks:
            b, w = divmod(flat, width)
            score = float(total[b, w])
            if score == float("-inf"):
                continue
            if w == EOS:
                norm = score / float(length_penalty(torch.tensor(t + 1), alpha))
                ended.append((norm, beams[b][0]))
                continue
            candidates.append((score, b, w, beams[b][2].after(w, constraints)))
        if len(ended) >= k or not candidates:
            break
        candidates.sort(key=lambda c: -c[0])
        kept = [candidates[i] for i in _allocate([c[3].tokens_met(constraints) for c in candidates], k)]
        origin = torch.tensor([c[1] for c in kept], device=device)
        state = select(state, origin)
        prev = torch.tensor([c[2] for c in kept], device=device)
        beams = [(beams[b][0] + [w], score, progress) for score, b, w, progress in kept]
    if not ended:  # no hypothesis met every constraint by the cap (check_constraints leaves room, so rare)
        log.warning("constrained search: no hypothesis holds all %d constraints within the cap of %d tokens; "
                    "returning the best one", len(constraints), cap)
        ended = [(max(b[1] for b in beams), max(beams, key=lambda b: b[1])[0])]
    ranked = sorted(ended, key=lambda e: -e[0])[:nbest]
    return [(tokens, score) for score, tokens in ranked], ranked[0][0]


def satisfied(outputs: list[str], constraints: list[list[str]]) -> float:
    """Percent of the constraints whose words appear, in order and whole, in their output."""
    hit = total = 0
    for out, phrases in zip(outputs, constraints):
        padded = f" {out} "
        for phrase in phrases:
            total += 1
            hit += f" {phrase} " in padded
    return 100.0 * hit / max(total, 1)


KINDS = ("free", "batched", "one_at_a_time")


def translate(translator: Translator, kind: str, sources: list[str], constraints: list[list[str]], batch: int) -> list[str]:
    """The translations of ``sources``, ``batch`` lines a call: without constraints, or with them
    through the batched search or the baseline."""
    out = []
    swap = mock.patch.object(translator_module, "constrained_beam_search", sentence_at_a_time)
    with swap if kind == "one_at_a_time" else contextlib.nullcontext():
        for i in range(0, len(sources), batch):
            cons = None if kind == "free" else constraints[i : i + batch]
            out += [t.text for t in translator.translate(sources[i : i + batch], constraints=cons)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", action="append", required=True, help="name=path, once per model")
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--words", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="sentences a batch")
    parser.add_argument("--precision", default="auto", help="the translator's precision: auto | 32 | bf16 | int8")
    parser.add_argument("--out", type=Path, default=Path("docs/results/constraints"))
    args = parser.parse_args()
    register_resolvers()
    rows = {}
    for spec in args.ckpt:
        name, _, path = spec.partition("=")
        # every call of --batch lines is one batch
        translator = Translator.load(path, device="cpu", precision=args.precision, max_tokens=1 << 20,
                                     decoding={"_target_": "nmt.decoding.search.beam_search", "beam_size": args.beam,
                                               "alpha": 0.6})
        sources, refs, _ = load_test_split({**translator.run_config["data"], "cache_dir": ".cache"}, path)
        sources, refs = sources[: args.pairs], refs[: args.pairs]
        rng = random.Random(0)
        constraints = [rng.sample(r.split(), min(args.words, len(r.split()))) for r in refs]
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        outputs: dict[str, list[str]] = {}
        for _ in range(args.rounds):
            for kind in KINDS:
                start = time.perf_counter()
                outputs[kind] = translate(translator, kind, sources, constraints, args.batch)
                times[kind].append(time.perf_counter() - start)
        seconds = {kind: statistics.median(times[kind]) for kind in KINDS}
        rows[name] = {
            "pairs": len(sources), "constraints": sum(map(len, constraints)),
            **{f"satisfied_{kind}": satisfied(outputs[kind], constraints) for kind in KINDS},
            **{f"bleu_{kind}": sacrebleu.corpus_bleu(outputs[kind], [refs]).score for kind in KINDS},
            **{f"seconds_{kind}": seconds[kind] for kind in KINDS},
            "speedup": seconds["one_at_a_time"] / seconds["batched"],
            "same_outputs": 100.0 * sum(a == b for a, b in zip(outputs["batched"], outputs["one_at_a_time"])) / len(sources),
        }
        print(name, rows[name], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "constraints.json").write_text(json.dumps({"words": args.words, "beam": args.beam, "batch": args.batch,
                                                           "precision": translator.precision, "threads": torch.get_num_threads(),
                                                           "rows": rows}, indent=2) + "\n")
    lines = ["| model | constraints | held, free | held, batched | held, one at a time | BLEU free | BLEU batched | "
             "BLEU one at a time | s free | s batched | s one at a time | speed-up | same outputs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['constraints']} | {r['satisfied_free']:.1f}% | {r['satisfied_batched']:.1f}% | "
                     f"{r['satisfied_one_at_a_time']:.1f}% | {r['bleu_free']:.1f} | {r['bleu_batched']:.1f} | "
                     f"{r['bleu_one_at_a_time']:.1f} | {r['seconds_free']:.1f} | {r['seconds_batched']:.1f} | "
                     f"{r['seconds_one_at_a_time']:.1f} | {r['speedup']:.1f}x | {r['same_outputs']:.1f}% |")
    (args.out / "constraints.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Synthetic parallel corpus between two made-up languages, the default offline data set.

Built to reproduce "BLEU vs sentence length" (Bahdanau et al., 2015, Fig. 2): the target is a
deterministic function of the source (a perfect model reaches BLEU 100), but its rules reach
across the whole sentence, so a fixed-vector encoder-decoder degrades with length while
attention does not. The lexicon comes from the fixed ``LEXICON_SEED``; the ``seed`` arguments
only pick sentences, so splits made with different seeds are the same language.

Source grammar (SVO; an NP takes at most one modifier, right after its noun, so the grammar is
LL(1) and unambiguous, see ``parse``)::

    S      -> CLAUSE (CONJ CLAUSE)*
    CLAUSE -> NP VERB [NP] [ADV]
    NP     -> DET ADJ{0,2} NOUN [PP | REL]      plural nouns end in "s"
    PP     -> PREP NP
    REL    -> "REL" VERB [NP]                    the noun is the subject of VERB

Target rules:

1. lexical: every source word has its own target word (syllables from disjoint alphabets);
   target nouns and adjectives take plural "n";
2. local reordering and agreement: adjectives follow the noun; the determiner takes the
   noun's target gender (lexical, two classes) and number;
3. long-distance reordering: the verb ends its clause and relative clause (SOV), after the
   adverb and the object: ``S V O ADV -> S ADV O V``;
4. agreement across distance: the verb ends in -ek/-en/-ot/-on for the gender and number of
   its subject, which can be many words back, past PPs, relative clauses and the object.

Example (``generate_pairs(1, seed=54, min_len=12, max_len=12)``), glossed word by word::

    src: ko  kudoke dumemas du  nudo do  gode nutu mikiba te  begakes tego
         DET ADJ    N.PL    REL V    DET ADJ  N    V      DET N.PL    ADV
    tgt: huls    filevin fizolin li  fa    fola wezu zusofion vizo ras     fewan luwosion
         DET.1PL N.PL    ADJ.PL  REL DET.0 N    ADJ  V.1PL    ADV  DET.0PL N.PL  V.1PL

(``.1PL``: gender 1, plural; the rel-clause verb and the main verb both agree with "dumemas")
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

LEXICON_SEED = 20150519  # fixes the language; never derived from a sampling seed
SIZES = {"noun": 120, "verb": 60, "adj": 50, "adv": 20, "det": 4, "prep": 10, "conj": 5, "rel": 1}
FUNCTION_WORDS = {"det", "prep", "conj", "rel"}  # one syllable; content words two or three
SRC_SYLLABLES = [c + v for c in "bdgkmnpt" for v in "aeiou"]
TGT_SYLLABLES = [c + v for c in "fhlrsvwz" for v in "aeiou"]
VERB_SUFFIX = {(0, False): "ek", (0, True): "en", (1, False): "ot", (1, True): "on"}  # (gender, plural)
DET_SUFFIX = {(0, False): "", (0, True): "s", (1, False): "l", (1, True): "ls"}
MAX_ADJS, MAX_DEPTH = 2, 2  # adjectives per NP; nesting of PP/REL inside NPs
# expansion -> (source words it adds, sampling weight)
GROWTH = {"adj": (1, 3), "adv": (1, 1), "obj": (2, 3), "rel": (2, 2), "pp": (3, 3), "clause": (4, 2)}


def _words(rng: random.Random, syllables: list[str]) -> dict[str, list[str]]:
    seen: set[str] = set()
    words: dict[str, list[str]] = {}
    for kind, n in SIZES.items():
        words[kind] = []
        while len(words[kind]) < n:
            k = 1 if kind in FUNCTION_WORDS else rng.choice((2, 3))
            word = "".join(rng.choice(syllables) for _ in range(k))
            if word not in seen:
                seen.add(word)
                words[kind].append(word)
    return words


def _lexicon() -> tuple[dict[str, list[str]], dict[str, list[str]], list[int]]:
    rng = random.Random(LEXICON_SEED)
    src, tgt = _words(rng, SRC_SYLLABLES), _words(rng, TGT_SYLLABLES)
    gender = [rng.randrange(2) for _ in tgt["noun"]]
    forms = [w + e for w in tgt["verb"] for e in VERB_SUFFIX.values()]
    forms += [w + e for w in tgt["det"] for e in DET_SUFFIX.values()]
    forms += [w + e for k in ("noun", "adj") for w in tgt[k] for e in ("", "n")]
    forms += [w for k in ("adv", "prep", "conj", "rel") for w in tgt[k]]
    assert len(forms) == len(set(forms)), "target word forms must be distinct"
    return src, tgt, gender


# word lists per class, SRC[k][i] translates to TGT[k][i]; GENDER[i]: target gender (0/1) of noun i
SRC, TGT, GENDER = _lexicon()


# Sentence tree; every int is an index into the word list of its class.
@dataclass(slots=True)
class NP:
    det: int
    noun: int
    plural: bool
    depth: int
    adjs: list[int] = field(default_factory=list)
    mod: PP | Rel | None = None


@dataclass(slots=True)
class PP:
    prep: int
    np: NP


@dataclass(slots=True)
class Rel:
    verb: int
    depth: int  # depth of its object NP
    obj: NP | None = None


@dataclass(slots=True)
class Clause:
    subj: NP
    verb: int
    conj: int | None  # the conjunction before it; None for the first clause
    obj: NP | None = None
    adv: int | None = None


Words = list[tuple[str, tuple[int, str]]]  # each word with the key of the element it renders


def _src_np(np: NP, out: Words) -> None:
    out.append((SRC["det"][np.det], (id(np), "det")))
    out.extend((SRC["adj"][a], (id(np), f"adj{k}")) for k, a in enumerate(np.adjs))
    out.append((SRC["noun"][np.noun] + "s" if np.plural else SRC["noun"][np.noun], (id(np), "noun")))
    if isinstance(np.mod, PP):
        out.append((SRC["prep"][np.mod.prep], (id(np.mod), "prep")))
        _src_np(np.mod.np, out)
    elif isinstance(np.mod, Rel):
        out += [(SRC["rel"][0], (id(np.mod), "rel")), (SRC["verb"][np.mod.verb], (id(np.mod), "verb"))]
        if np.mod.obj is not None:
            _src_np(np.mod.obj, out)


def _tgt_np(np: NP, out: Words) -> None:
    agr = (GENDER[np.noun], np.plural)
    num = "n" if np.plural else ""
    out += [(TGT["det"][np.det] + DET_SUFFIX[agr], (id(np), "det")), (TGT["noun"][np.noun] + num, (id(np), "noun"))]
    out.extend((TGT["adj"][a] + num, (id(np), f"adj{k}")) for k, a in enumerate(np.adjs))
    if isinstance(np.mod, PP):
        out.append((TGT["prep"][np.mod.prep], (id(np.mod), "prep")))
        _tgt_np(np.mod.np, out)
    elif isinstance(np.mod, Rel):
        out.append((TGT["rel"][0], (id(np.mod), "rel")))
        if np.mod.obj is not None:
            _tgt_np(np.mod.obj, out)
        out.append((TGT["verb"][np.mod.verb] + VERB_SUFFIX[agr], (id(np.mod), "verb")))


def render(clauses: list[Clause]) -> tuple[str, str]:
    """Source and target sentence of a parsed or generated sentence."""
    src, tgt, _ = render_aligned(clauses)
    return src, tgt


def render_aligned(clauses: list[Clause]) -> tuple[str, str, str]:
    """Source, target and their gold word alignment in Pharaoh format (``"0-0 1-2 ..."``, source
    index first): every target word renders exactly one source word (rule 1), so the alignment is
    one-to-one and covers both sides."""
    src: Words = []
    tgt: Words = []
    for c in clauses:
        if c.conj is not None:
            src.append((SRC["conj"][c.conj], (id(c), "conj")))
            tgt.append((TGT["conj"][c.conj], (id(c), "conj")))
        _src_np(c.subj, src)
        src.append((SRC["verb"][c.verb], (id(c), "verb")))
        _tgt_np(c.subj, tgt)
        if c.obj is not None:
            _src_np(c.obj, src)
        if c.adv is not None:
            src.append((SRC["adv"][c.adv], (id(c), "adv")))
            tgt.append((TGT["adv"][c.adv], (id(c), "adv")))
        if c.obj is not None:
            _tgt_np(c.obj, tgt)
        tgt.append((TGT["verb"][c.verb] + VERB_SUFFIX[GENDER[c.subj.noun], c.subj.plural], (id(c), "verb")))
    where = {key: i for i, (_, key) in enumerate(src)}
    links = " ".join(f"{where[key]}-{t}" for t, (_, key) in enumerate(tgt))
    return " ".join(w for w, _ in src), " ".join(w for w, _ in tgt), links


def gold_alignment(source: str) -> str:
    """The Pharaoh word alignment of ``source`` and its translation (``translate(source)``)."""
    return render_aligned(parse(source))[2]


def _np(rng: random.Random, depth: int) -> NP:
    return NP(rng.randrange(SIZES["det"]), rng.randrange(SIZES["noun"]), rng.random() < 0.4, depth)


def _grow(rng: random.Random, kind: str, clauses: list[Clause], nps: list[NP], heads: list[Clause | Rel]) -> bool:
    """Apply one expansion in place; False when the picked node has no room for it."""
    if kind == "clause":
        clause = Clause(_np(rng, 0), rng.randrange(SIZES["verb"]), rng.randrange(SIZES["conj"]))
        clauses.append(clause)
        nps.append(clause.subj)
        heads.append(clause)
    elif kind == "adv":
        clause = rng.choice(clauses)
        if clause.adv is not None:
            return False
        clause.adv = rng.randrange(SIZES["adv"])
    elif kind == "obj":  # heads: clauses and relative clauses, which may take an object
        head = rng.choice(heads)
        if head.obj is not None:
            return False
        head.obj = _np(rng, head.depth if isinstance(head, Rel) else 0)
        nps.append(head.obj)
    else:
        np = rng.choice(nps)
        if kind == "adj":
            if len(np.adjs) >= MAX_ADJS:
                return False
            np.adjs.append(rng.randrange(SIZES["adj"]))
        elif np.mod is not None or np.depth >= MAX_DEPTH:
            return False
        elif kind == "pp":
            np.mod = PP(rng.randrange(SIZES["prep"]), _np(rng, np.depth + 1))
            nps.append(np.mod.np)
        else:
            np.mod = Rel(rng.randrange(SIZES["verb"]), np.depth + 1)
            heads.append(np.mod)
    return True


# expansions that fit in r more words (r = 1..4; 4 = all), each repeated by its weight
_FITTING = {r: [k for k, (n, w) in GROWTH.items() if n <= r for _ in range(w)] for r in range(1, 5)}


def sample_sentence(rng: random.Random, length: int) -> list[Clause]:
    """Grow a sentence from ``NP VERB`` (3 words) by random expansions until it has ``length`` words."""
    clauses = [Clause(_np(rng, 0), rng.randrange(SIZES["verb"]), None)]
    nps, heads = [clauses[0].subj], [clauses[0]]
    size, misses = 3, 0
    while size < length and misses < 50:
        kind = rng.choice(_FITTING[min(length - size, 4)])
        if _grow(rng, kind, clauses, nps, heads):
            size += GROWTH[kind][0]
            misses = 0
        else:
            misses += 1
    return clauses


_SRC_INDEX = {w: (k, i) for k, ws in SRC.items() for i, w in enumerate(ws)}  # word -> (class, index)
_SRC_INDEX.update({w + "s": ("plural", i) for i, w in enumerate(SRC["noun"])})


def parse(source: str) -> list[Clause]:
    """Parse a source sentence (recursive descent, one word of look-ahead)."""
    toks = [_SRC_INDEX[w] for w in source.split()] + [("end", -1)]
    pos = 0

    def take(*kinds: str) -> int:
        nonlocal pos
        kind, i = toks[pos]
        if kind not in kinds:
            raise ValueError(f"expected {kinds} at word {pos} of {source!r}, got {kind}")
        pos += 1
        return i

    def noun_phrase(depth: int) -> NP:
        det = take("det")
        adjs = []
        while toks[pos][0] == "adj":
            adjs.append(take("adj"))
        np = NP(det, -1, toks[pos][0] == "plural", depth, adjs)
        np.noun = take("noun", "plural")
        if toks[pos][0] == "prep":
            np.mod = PP(take("prep"), noun_phrase(depth + 1))
        elif toks[pos][0] == "rel":
            take("rel")
            np.mod = Rel(take("verb"), depth + 1)
            if toks[pos][0] == "det":
                np.mod.obj = noun_phrase(depth + 1)
        return np

    clauses: list[Clause] = []
    while not clauses or toks[pos][0] != "end":
        conj = take("conj") if clauses else None
        clause = Clause(noun_phrase(0), -1, conj)
        clause.verb = take("verb")
        if toks[pos][0] == "det":
            clause.obj = noun_phrase(0)
        if toks[pos][0] == "adv":
            clause.adv = take("adv")
        clauses.append(clause)
    return clauses


def translate(source: str) -> str:
    """Reference translation by rule: ``parse`` then render; equals the generated target."""
    return render(parse(source))[1]


LENGTHS = ("uniform", "natural")
NATURAL_SIGMA = 0.6  # log-normal spread of "natural" lengths: 5% of sentences are over 2.7x the median


def sample_length(rng: random.Random, lengths: str, low: int, high: int, median: float) -> int:
    """A sentence length in [low, high] words: ``uniform``, or ``natural`` (log-normal around
    ``median``, skewed to short sentences with a long tail, like real text; Europarl's median
    is ~23 words)."""
    if lengths == "uniform":
        return rng.randint(low, high)
    if lengths != "natural":
        raise ValueError(f"unknown sentence length distribution {lengths!r}; choose one of {', '.join(LENGTHS)}")
    while True:  # rejection keeps the shape inside [low, high] instead of piling mass on the ends
        n = round(rng.lognormvariate(math.log(median), NATURAL_SIGMA))
        if low <= n <= high:
            return n


def iter_pairs(num_pairs: int, seed: int = 0, min_len: int = 5, max_len: int = 80, lengths: str = "uniform",
               median_len: float = 15) -> Iterator[tuple[str, str]]:
    """Yield num_pairs (source, target) sentence pairs with source lengths (in words) in
    [min_len, max_len], drawn from the ``lengths`` distribution (see ``sample_length``)."""
    rng = random.Random(seed)
    low = max(min_len, 3)  # the shortest sentence is DET NOUN VERB
    high = max(low, max_len)
    for _ in range(num_pairs):
        yield render(sample_sentence(rng, sample_length(rng, lengths, low, high, median_len)))


def generate_pairs(num_pairs: int, seed: int = 0, min_len: int = 5, max_len: int = 80, lengths: str = "uniform",
                   median_len: float = 15) -> list[tuple[str, str]]:
    """The pairs of ``iter_pairs`` as a list."""
    return list(iter_pairs(num_pairs, seed, min_len, max_len, lengths, median_len))


def write_corpus(out_dir: str | Path, splits: dict[str, int], seed: int = 0, min_len: int = 5, max_len: int = 80,
                 src_lang: str = "src", tgt_lang: str = "tgt", lengths: dict[str, str] | None = None,
                 median_len: float = 15, chunk: int = 10000) -> Path:
    """Write <split>.<src_lang> and <split>.<tgt_lang> files (one sentence per line, UTF-8) for each
    split name -> pair count, each split with its own seed (seed*1000 + index of the split) so
    splits differ, and its length distribution from ``lengths`` (split -> name; default uniform);
    return out_dir. Pairs are written ``chunk`` at a time, so memory does not grow with the corpus."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = lengths or {}
    for index, (split, num_pairs) in enumerate(splits.items()):
        pairs = iter_pairs(num_pairs, seed * 1000 + index, min_len, max_len, lengths.get(split, "uniform"), median_len)
        with open(out_dir / f"{split}.{src_lang}", "w", encoding="utf-8", newline="\n") as src, \
                open(out_dir / f"{split}.{tgt_lang}", "w", encoding="utf-8", newline="\n") as tgt:
            while block := list(itertools.islice(pairs, chunk)):
                src.write("".join(s + "\n" for s, _ in block))
                tgt.write("".join(t + "\n" for _, t in block))
        log.info("wrote %d pairs to %s/%s.{%s,%s}", num_pairs, out_dir, split, src_lang, tgt_lang)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic parallel corpus.")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train", type=int, default=50000)
    parser.add_argument("--valid", type=int, default=1000)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--min-len", type=int, default=3)
    parser.add_argument("--max-len", type=int, default=60)
    parser.add_argument("--lengths", choices=LENGTHS, default="natural", help="train/valid length distribution")
    parser.add_argument("--test-lengths", choices=LENGTHS, default="uniform",
                        help="test length distribution (uniform: every length bucket equally filled)")
    parser.add_argument("--median-len", type=float, default=15, help="median length of 'natural' sentences")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    splits = {"train": args.train, "valid": args.valid, "test": args.test}
    lengths = {"train": args.lengths, "valid": args.lengths, "test": args.test_lengths}
    write_corpus(args.out, splits, args.seed, args.min_len, args.max_len, lengths=lengths, median_len=args.median_len)


if __name__ == "__main__":
    main()

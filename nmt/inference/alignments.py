"""Word alignments from attention, in Pharaoh format, and their error rate against gold ones.

A model attends over source *subwords* while writing target subwords. Each target subword is
aligned to the source subword it attends to most (EOS excluded on both sides), and the pairs
are lifted to words: a SentencePiece piece starting with "▁" starts a word. The result is the
set of (source word, target word) pairs, written ``0-0 1-2 ...`` (source index first, both from
0), as fast_align, Moses and Marian write them. A side in a language written without spaces
(``nmt.languages.writing``'s ``chars``: Chinese, Japanese, Thai, ...) can be lifted to characters instead,
each piece to its first character, spaces not counted. No torch here.

``aer`` is Och and Ney's (2003) alignment error rate, 1 - (|A∩S| + |A∩P|) / (|A| + |S|), with
sure links S and possible links P (P ⊇ S); with one gold set, S = P.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

WORD_START = "\u2581"  # SentencePiece's word-boundary mark


def word_of_pieces(pieces: Sequence[str]) -> list[int]:
    """The word index of each piece: a piece starting with "▁" (or the first piece) starts a word."""
    words, current = [], -1
    for i, piece in enumerate(pieces):
        if i == 0 or piece.startswith(WORD_START):
            current += 1
        words.append(current)
    return words


def unit_of_pieces(pieces: Sequence[str], unit: str = "words") -> list[int]:
    """The position of each piece in its sentence: its word (``word_of_pieces``) for ``words``, its
    first character (spaces and "▁" not counted) for ``chars``."""
    if unit == "words":
        return word_of_pieces(pieces)
    if unit != "chars":
        raise ValueError(f"alignment unit must be 'words' or 'chars', got {unit!r}")
    positions, chars = [], 0
    for piece in pieces:
        positions.append(chars)
        chars += len("".join(piece.replace(WORD_START, " ").split()))
    return positions


def pharaoh(source: Sequence[str], target: Sequence[str], weights: Sequence[Sequence[float]], skip: int = 0,
            units: tuple[str, str] = ("words", "words")) -> str:
    """``"s-t ..."`` word alignments of ``source`` and ``target`` pieces (EOS left out) from the
    (target pieces x source pieces) attention ``weights``; columns past the source's are ignored.
    ``skip``: leading source words that are not the sentence's (a multilingual model's target-language
    tag, ``nmt.languages.tags.tag_words``): links to them are left out, the others counted from the next.
    ``units``: what the source and target indices count (``unit_of_pieces``: words or chars)."""
    if not source or not target:
        return ""
    src_words = word_of_pieces(source)
    src_units, tgt_units = unit_of_pieces(source, units[0]), unit_of_pieces(target, units[1])
    offset = next((p for w, p in zip(src_words, src_units) if w >= skip), 0)  # where the sentence's own words start
    links = set()
    for t in range(len(target)):
        row = weights[t]
        s = max(range(len(source)), key=row.__getitem__)
        if src_words[s] >= skip:
            links.add((src_units[s] - offset, tgt_units[t]))
    return " ".join(f"{s}-{t}" for s, t in sorted(links, key=lambda link: (link[1], link[0])))


def parse(text: str, where: str = "alignment") -> set[tuple[int, int]]:
    """The links of a Pharaoh line (``"0-0 1-2"``; ``p`` links ``0p1`` are read as links too)."""
    links = set()
    for item in text.split():
        left, sep, right = item.replace("p", "-").partition("-")
        if not sep or not left.isdigit() or not right.isdigit():
            raise ValueError(f"{where}: {item!r} is not a link 'source-target' of two word indices")
        links.add((int(left), int(right)))
    return links


def aer(hypotheses: Iterable[set[tuple[int, int]]], sure: Iterable[set[tuple[int, int]]],
        possible: Iterable[set[tuple[int, int]]] | None = None) -> float:
    """The alignment error rate of a corpus of alignments (sums over sentences, then the ratio)."""
    hyps, sure = list(hypotheses), list(sure)
    poss = list(possible) if possible is not None else sure
    if not len(hyps) == len(sure) == len(poss):
        raise ValueError(f"aer: {len(hyps)} hypotheses, {len(sure)} sure and {len(poss)} possible alignments")
    a_s = sum(len(a & s) for a, s in zip(hyps, sure))
    a_p = sum(len(a & (p | s)) for a, s, p in zip(hyps, sure, poss))
    total = sum(len(a) for a in hyps) + sum(len(s) for s in sure)
    return 1.0 - (a_s + a_p) / total if total else 0.0

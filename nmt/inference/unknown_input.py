"""How much of an input its model cannot read: the share of the source's subword pieces that are
unknown to the model's source vocabulary. A piece is unknown when it is ``<unk>`` or a
byte-fallback piece, or when it belongs to a word of an alphabetic script (one that separates
words with spaces) of at least ``SPELLED`` letters that the vocabulary could only spell out
letter by letter: English typed into a model of another language mostly splits so, while a word
the model knows is one piece or a few. Chinese and Japanese are left out of the spelling rule:
one character is a whole piece there.

``Translator`` warns once (per translator) where a translation's input is mostly unknown
(``MOSTLY``): a model asked to translate a language it never saw answers with confident
nonsense, and nothing else would say why.
"""

from __future__ import annotations

from collections.abc import Sequence

from nmt.data.tokenizer import Tokenizer

SPELLED = 3  # letters of the shortest word counted as spelled out
MOSTLY = 0.5  # the share of unknown pieces above which a translation warns
SPACED_SCRIPTS_END = 0x0E00  # code points below Thai: Latin, Greek, Cyrillic, Armenian, Hebrew, Arabic, Indic


def _spelled_out(pieces: list[str]) -> bool:
    letters = "".join(pieces).replace("▁", "")
    return (len(letters) >= SPELLED and all(len(p.replace("▁", "")) <= 1 for p in pieces)
            and all(c.isalpha() and ord(c) < SPACED_SCRIPTS_END for c in letters))


def unknown_pieces(vocab: Tokenizer, ids: Sequence[int]) -> int:
    """How many of one sentence's pieces ``ids`` (specials aside) are unknown (see the module's docstring)."""
    sp = vocab.sp
    unknown, word, word_unknown = 0, [], False

    def close() -> int:
        return len(word) if word and (word_unknown or _spelled_out(word)) else 0

    for i in ids:
        i = int(i)
        if sp.is_control(i):
            continue
        piece = sp.id_to_piece(i)
        if piece.startswith("▁"):
            unknown += close()
            word, word_unknown = [], False
        word.append(piece)
        word_unknown |= bool(sp.is_unknown(i) or sp.is_byte(i))
    return unknown + close()


def unknown_share(vocab: Tokenizer, encoded: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(unknown pieces, pieces) over the sentences ``encoded`` (control pieces, EOS among them, aside)."""
    sp = vocab.sp
    total = sum(1 for ids in encoded for i in ids if not sp.is_control(int(i)))
    return sum(unknown_pieces(vocab, ids) for ids in encoded), total

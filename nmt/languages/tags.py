"""Target-language tags of multilingual models: ``<2xx>`` as the first word of the source.

A multilingual model (``nmt.data.multilingual``) reads which language to translate into from a tag
that starts the source sentence, ``<2fr> A man rides a bike.`` (Johnson et al. 2017). The tags are
pieces of their own in the SentencePiece vocabulary, so a model's target languages are read from
its vocabulary (``tag_languages``), for a checkpoint, a release file or a CTranslate2 folder alike.
``with_target_language`` adds the tag the user asks for (``tgt_lang=fr``) to each sentence, or
checks that each sentence starts with a tag of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

LANGUAGE = re.compile(r"[a-z]{2,3}(?:_[A-Za-z0-9]{1,8})?")  # ISO 639 codes, optionally a script or region: pt_BR
TAG = re.compile(r"<2(" + LANGUAGE.pattern + r")>")


def tag(lang: str) -> str:
    """The tag of a language code: ``fr`` -> ``<2fr>``; a ValueError for anything else."""
    if not isinstance(lang, str) or not LANGUAGE.fullmatch(lang):
        raise ValueError(f"{str(lang)[:40]!r} is not a language code (two or three lower-case letters, e.g. fr, "
                         "optionally _ and a script or region: pt_BR)")
    return f"<2{lang}>"


def split_tag(text: str) -> tuple[str | None, str]:
    """(the language of the tag that starts ``text``, or None; the text without it)."""
    first, _, rest = text.lstrip().partition(" ")
    found = TAG.fullmatch(first)
    return (found.group(1), rest.lstrip()) if found else (None, text)


def tag_languages(pieces: Iterable[str]) -> list[str]:
    """The languages whose tags are pieces of a vocabulary, sorted (empty: not multilingual); a tag
    piece may start with a word boundary (``▁<2fra>``: an imported Marian model's, ``nmt.checkpoints.marian``)."""
    return sorted(found.group(1) for piece in pieces if (found := TAG.fullmatch(piece.removeprefix("\u2581"))))


def tag_in_vocabulary(sp: Any, text: str) -> bool:
    """Whether a SentencePiece processor holds the tag ``text`` (``<2fr>``) as a piece of its own:
    ``<2fr>`` (nmt's own vocabularies) or ``▁<2fr>`` (an imported model's)."""
    return any(sp.piece_to_id(piece) != sp.unk_id() for piece in (text, "\u2581" + text))


def vocabulary_languages(sp: Any) -> list[str]:
    """``tag_languages`` of a SentencePiece processor's pieces."""
    return tag_languages(sp.id_to_piece(i) for i in range(sp.get_piece_size()))


def tag_words(pieces: Sequence[str]) -> int:
    """1 when a sentence's source pieces start with a target-language tag word (``["▁", "<2fr>",
    "▁hund"]``), else 0: the source words alignments leave out (``nmt.inference.alignments.pharaoh``)."""
    first = []
    for i, piece in enumerate(pieces):
        if i and piece.startswith("\u2581"):
            break
        first.append(piece)
    return 1 if TAG.fullmatch("".join(first).lstrip("\u2581")) else 0


def with_target_language(texts: list[str], lang: str | None, languages: list[str], where: str = "tgt_lang",
                         numbers: list[int] | None = None, line: str = "line") -> list[str]:
    """``texts`` ready for a model whose target ``languages`` are these (empty for one direction).

    With ``lang``, each non-empty text gets its tag; one that already starts with a tag is an error.
    Without, a multilingual model's texts must each start with the tag of one of its languages
    (a file of mixed directions). A ValueError names ``where`` and the ``line`` (``numbers``: the
    texts' numbers, default from 1): a language the model has no tag for, a text without a tag,
    or ``lang`` given to a model of one direction. Empty texts stay as they are."""
    if not languages:
        if lang is not None:
            raise ValueError(f"{where}={str(lang)[:40]}: this model translates one direction (its vocabulary has no "
                             "target-language tags); leave tgt_lang unset")
        return texts
    known = ", ".join(languages)
    if lang is not None and lang not in languages:
        raise ValueError(f"{where}={str(lang)[:40]}: unknown language tag; this model translates into {known}")
    numbers = numbers or list(range(1, len(texts) + 1))
    out = []
    for number, text in zip(numbers, texts):
        own, _ = split_tag(text)
        if not text.strip():
            out.append(text)
        elif lang is not None:
            if own is not None:
                raise ValueError(f"{where}={lang}: {line} {number} already starts with the tag <2{own}>; remove it, "
                                 "or leave tgt_lang unset to keep each line's own tag")
            out.append(f"{tag(lang)} {text}")
        elif own is None:
            raise ValueError(f"{where}: {line} {number} has no target-language tag; this model is multilingual: set "
                             f"tgt_lang to one of {known}, or start each {line} with its tag, e.g. <2{languages[0]}>")
        elif own not in languages:
            raise ValueError(f"{where}: {line} {number} starts with <2{own}>, an unknown language tag; this model "
                             f"translates into {known}")
        else:
            out.append(text)
    return out

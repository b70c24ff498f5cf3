"""Target-language tags of multilingual models: ``<2xx>`` as the first word of the source.

A multilingual model (``nmt.data.multilingual``) reads which language to translate into from a tag
that starts the source sentence, ``<2fr> A man rides a bike.`` (Johnson et al. 2017). The tags are
pieces of their own in the SentencePiece vocabulary, so a model's target languages are read from
its vocabulary (``tag_languages``), for a checkpoint, a release file or a CTranslate2 folder alike.
``with_target_language`` adds the tag the user asks for (``tgt_lang=fr``) to each sentence.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
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
    """The languages whose tags are pieces of a vocabulary, sorted (empty: not multilingual)."""
    return sorted(found.group(1) for piece in pieces if (found := TAG.fullmatch(piece)))


def vocabulary_languages(sp: Any) -> list[str]:
    """``tag_languages`` of a SentencePiece processor's pieces."""
    return tag_languages(sp.id_to_piece(i) for i in range(sp.get_piece_size()))


def with_target_language(texts: list[str], lang: str | None, languages: list[str], where: str = "tgt_lang",
                         numbers: list[int] | None = None, line: str = "line") -> list[str]:
    """``texts`` each starting with the tag of ``lang`` (empty texts stay empty), checked against
    the model's target ``languages``: a ValueError naming ``where`` when the model is multilingual
    and no language is given, the language is not one of its own, or a sentence already starts
    with a tag (``numbers``: the sentences' numbers for the message, from 1). A model of one
    direction takes ``lang`` None and leaves the texts as they are."""
    if not languages:
        if lang is not None:
            raise ValueError(f"{where}={str(lang)[:40]}: this model translates one direction (its vocabulary has no "
                             "target-language tags); leave tgt_lang unset")
        return texts
    known = ", ".join(languages)
    if lang is None:
        raise ValueError(f"{where}: this model is multilingual; set tgt_lang to the language to translate into, "
                         f"one of {known}")
    if lang not in languages:
        raise ValueError(f"{where}={str(lang)[:40]}: unknown language tag; this model translates into {known}")
    numbers = numbers or list(range(1, len(texts) + 1))
    out = []
    for number, text in zip(numbers, texts):
        own, _ = split_tag(text)
        if own is not None:
            raise ValueError(f"{where}={lang}: {line} {number} already starts with the tag <2{own}>; remove it "
                             "(the tag of tgt_lang is added to every sentence)")
        out.append(f"{tag(lang)} {text}" if text.strip() else text)
    return out

"""What a translation request means, checked in one place for every front end (translate.py,
nmt-serve, evaluate, the Python API): the target language of a multilingual model (its tag on each
sentence, ``nmt.languages.tags``) and what guides each translation (a prefix it starts with, or phrases
it must hold). A model imported with its language codes as the decoder's first token (M2M100,
NLLB-200, mBART-50: ``nmt.checkpoints.m2m100``) reads the source language as a tag on each sentence
(``src_lang``) and the target language as a forced first target token (``Prepared.lead``). A front
end reads a request its own way (files, JSON) and reports a ``RequestError`` in its own form (one
line on stderr, HTTP 400); the words are the same everywhere, with the names the front end gives its
options (``Naming``). No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nmt.languages.tags import with_target_language

GUIDES = ("prefixes", "constraints")


class RequestError(ValueError):
    """A request the translator cannot take; the message names the option and the sentence."""


@dataclass(frozen=True)
class Request:
    """The sentences to translate, the language to translate them into (a multilingual model's;
    None: each sentence's own tag, or a model of one direction), and at most one kind of guide: a
    prefix per sentence ("" for none) or a list of phrases per sentence ([] for none)."""

    texts: Sequence[str]
    tgt_lang: str | None = None
    prefixes: Sequence[str] | None = None
    constraints: Sequence[Sequence[str]] | None = None
    src_lang: str | None = None  # a model whose decoder starts with the target language: the source's


@dataclass(frozen=True)
class Naming:
    """How a front end names the parts of a request in its errors: each text's number
    (``numbers``, default 1..n), what a text is (``item``: line, sentence, test pair) and its
    options (``tgt_lang``, ``prefixes``, ``constraints``: a key, a field, ``prefixes=<file>``)."""

    numbers: Sequence[int] | None = None
    item: str = "line"
    tgt_lang: str = "tgt_lang"
    src_lang: str = "src_lang"
    prefixes: str = "prefixes"
    constraints: str = "constraints"

    def number_of(self, count: int) -> list[int]:
        return list(self.numbers) if self.numbers is not None else list(range(1, count + 1))


@dataclass
class Prepared:
    """A request as the model reads it: the sources with their target-language tags, and each
    sentence's guide as target ids (``prefixes``: ids; ``constraints``: a tuple of ids per phrase;
    empty for an empty sentence or none), or None without guides."""

    sources: list[str]
    prefixes: list[list[int]] | None = None
    constraints: list[list[tuple[int, ...]]] | None = None
    numbers: list[int] = field(default_factory=list)
    lead: list[int] = field(default_factory=list)  # target ids every output starts with, cut from the text


class RequestMeaning:
    """What the translators share: ``prepare`` checks a request against the model. A translator
    sets ``target_languages`` (empty for one direction) and ``backend``; one that decodes guides
    sets ``can_guide`` and gives ``guide_ids`` (``lead``: the forced tokens every output starts with,
    which a guide must leave room for)."""

    backend = "?"
    can_guide = False  # True: the translator has guide_ids(key, guides, sources, where, numbers, item, lead)
    target_languages: list[str]
    decoder_languages = False  # True: the source language is a tag, the target one the decoder's first token

    def release(self) -> None:
        """Give back what decoding keeps between batches (a torch model's captured CUDA graphs):
        translate.py calls it at its end; a backend that keeps nothing does nothing."""

    def prepare(self, request: Request, naming: Naming = Naming()) -> Prepared:
        """``request`` checked and made ready, or a ``RequestError``: a language the model has no tag
        for or a sentence without one (``nmt.languages.tags.with_target_language``); both kinds of
        guide; guides on a backend that cannot decode them; not one guide per sentence; a guide
        piece the target vocabulary lacks or one that leaves no room under the length cap."""
        numbers = naming.number_of(len(request.texts))
        lead: list[int] = []
        if self.decoder_languages:
            known = ", ".join(self.target_languages)
            for key, lang in ((naming.tgt_lang, request.tgt_lang), (naming.src_lang, request.src_lang)):
                if lang is None:
                    raise RequestError(f"{key}: this model reads the source language first and writes the target "
                                       f"language as its first output token: set src_lang and tgt_lang, each one of "
                                       f"{known}")
                if lang not in self.target_languages:
                    raise RequestError(f"{key}={str(lang)[:40]}: unknown language code; this model knows {known}")
            texts, lang, lead = list(request.texts), request.src_lang, self.lead_ids(request.tgt_lang)  # type: ignore[attr-defined]
            where = naming.src_lang
        else:
            if request.src_lang is not None:
                raise RequestError(f"{naming.src_lang}={str(request.src_lang)[:40]}: this model takes no source "
                                   "language; leave src_lang unset")
            texts, lang, where = list(request.texts), request.tgt_lang, naming.tgt_lang
        try:
            sources = with_target_language(texts, lang, self.target_languages, where=where, numbers=numbers,
                                           line=naming.item)
        except ValueError as e:
            raise RequestError(str(e)) from None
        given = [key for key in GUIDES if getattr(request, key) is not None]
        if not given:
            return Prepared(sources, numbers=numbers, lead=lead)
        if len(given) > 1:
            raise RequestError(f"{naming.prefixes} and {naming.constraints}: give one of the two")
        (key,) = given
        where = getattr(naming, key)
        if not self.can_guide:
            raise RequestError(f"{where}: {key} are decoded by the torch backend, not by {self.backend}")
        guides = list(getattr(request, key))
        if len(guides) != len(sources):
            raise RequestError(f"{where}: {len(guides)} given for {len(sources)} {naming.item}s; give one per "
                               f"{naming.item}")
        todo = [i for i, text in enumerate(sources) if text.strip()]
        guide_ids = self.guide_ids  # type: ignore[attr-defined]  # a translator that can_guide has it
        ids = guide_ids(key, [guides[i] for i in todo], [sources[i] for i in todo], where, [numbers[i] for i in todo],
                        naming.item, lead)
        per_text: list[Any] = [[] for _ in sources]
        for i, value in zip(todo, ids):
            per_text[i] = value
        return Prepared(sources, numbers=numbers, lead=lead, **{key: per_text})

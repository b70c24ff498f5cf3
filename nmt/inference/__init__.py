"""Inference: the Translator every front end uses (on torch or CTranslate2), what a request means,
and the rows it returns.

``from nmt.inference import Translator`` (or ``CTranslate2Translator``) is the API; each is
imported only when asked for, so the CTranslate2 path never imports torch."""

API = {"Translator": "nmt.inference.translator", "CTranslate2Translator": "nmt.inference.ctranslate2"}


def __getattr__(name: str):
    if name in API:
        import importlib

        return getattr(importlib.import_module(API[name]), name)
    raise AttributeError(f"module 'nmt.inference' has no attribute {name!r}")

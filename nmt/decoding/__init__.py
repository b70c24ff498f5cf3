"""Decoding: greedy, beam, sampling and constrained search over any model, and their settings.

``nmt.decoding.beam_search`` (and ``greedy_search``, ``sample_search``) still name the search
functions of ``nmt.decoding.search``, as configs written before this package did; they are imported
only when asked for, so ``nmt.decoding.settings`` stays free of torch."""

SEARCHES = ("greedy_search", "beam_search", "sample_search")


def __getattr__(name: str):
    if name in SEARCHES:
        from nmt.decoding import search

        return getattr(search, name)
    raise AttributeError(f"module 'nmt.decoding' has no attribute {name!r}")

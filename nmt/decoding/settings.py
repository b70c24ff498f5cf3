"""The decoding a user chose (``conf/decoding/{beam,greedy,sample}.yaml``), read once into plain
values that both backends use: the torch ``Translator`` builds ``nmt.decoding.search``'s search from
them, the CTranslate2 one its ``translate_batch`` options. No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

DEFAULT_ALPHA = 0.6  # the GNMT length penalty of a model whose run did not choose one (Wu et al. 2016 used 0.6-0.7)
SEARCHES = {"nmt.decoding.search.beam_search": "beam", "nmt.decoding.search.greedy_search": "greedy",
            "nmt.decoding.search.sample_search": "sample"}
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed")
# What a user may type, checked before any allocation: key -> (type, lowest, highest). Searches keep
# a (sentences x beam x steps) table of tokens, so a beam of 100,000 or a cap of 10^9 steps would be
# gigabytes allocated before the first step.
BOUNDS: dict[str, tuple[type, float, float]] = {
    "beam_size": (int, 1, 256), "nbest": (int, 1, 256), "alpha": (float, 0.0, 10.0), "max_len_a": (float, 0.0, 100.0),
    "max_len_b": (int, 0, 10_000), "temperature": (float, 0.0, 100.0), "top_k": (int, 0, 1 << 20),
    "top_p": (float, 0.0, 1.0), "seed": (int, 0, (1 << 63) - 1), "graph_cache_mb": (float, 0.0, float(1 << 20))}
GRAPH_CACHE_MB = 2048  # MiB of tensors a model's kept CUDA-graph searches hold at most (``nmt.decoding.fixed_beam``)
ENGINES = ("auto", "loop", "fixed", "graphs")  # how ``nmt.decoding.search``'s greedy and beam search run
# How beam search ranks ended hypotheses: GNMT's length penalty (Wu et al. 2016) with a stop that never
# changes the result, or Hugging Face transformers' score / length ** alpha with its stopping rule
# (``early_stopping``: false, true or "never") and forced tokens scored 0, as ``generate()`` does.
SCORINGS = ("gnmt", "huggingface")
EARLY_STOPPING = (False, True, "never")
KEYS = {"beam": ("beam_size", "alpha", "nbest", "max_len_a", "max_len_b", "alignments", "engine", "scoring",
                 "early_stopping", "graph_cache_mb"),
        "greedy": ("max_len_a", "max_len_b", "alignments", "engine", "graph_cache_mb"), "sample": ("max_len_a", "max_len_b", "alignments", *SAMPLING_KEYS)}


@dataclass(frozen=True)
class SearchSettings:
    search: str = "beam"  # beam | greedy | sample
    beam_size: int = 5
    alpha: float | None = None  # GNMT length penalty; None: the model's (``for_model``)
    nbest: int = 1
    max_len_a: float = 1.5  # at most a * source tokens + b output tokens
    max_len_b: int = 10
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_k, top_p, seed
    alignments: bool = False  # a Pharaoh word alignment beside each hypothesis (not a search option)
    engine: str = "auto"  # how greedy and beam search run on torch (``ENGINES``); the result is the same
    scoring: str | None = None  # how beam search ranks ended hypotheses (``SCORINGS``); None: the model's, else gnmt
    early_stopping: bool | str = False  # scoring=huggingface's stopping rule (``EARLY_STOPPING``)
    graph_cache_mb: float = GRAPH_CACHE_MB  # the MiB a model's kept captured searches hold (engine=graphs on a GPU)

    @classmethod
    def from_config(cls, decoding: Mapping[str, Any] | None) -> SearchSettings:
        """A ``decoding`` config group (``_target_`` one of ``SEARCHES``); a ValueError names a bad key."""
        if decoding is None:
            return cls()
        decoding = dict(decoding)
        target = str(decoding.pop("_target_", ""))
        decoding.pop("_partial_", None)
        if target not in SEARCHES:
            raise ValueError(f"decoding._target_={target}: choose decoding=beam, greedy or sample "
                             f"({', '.join(SEARCHES)})")
        search = SEARCHES[target]
        unknown = sorted(set(decoding) - set(KEYS[search]))
        if unknown:
            raise ValueError(f"decoding.{unknown[0]}: not an option of {search} search "
                             f"(its options: {', '.join(KEYS[search])})")
        values: dict[str, Any] = {"search": search}
        for key in ("beam_size", "nbest", "alpha", "max_len_a", "max_len_b", "graph_cache_mb"):
            if decoding.get(key) is not None:
                values[key] = bounded(decoding[key], key)
        if search != "beam":
            values["beam_size"] = 1
        sampling = {k: bounded(decoding[k], k) for k in SAMPLING_KEYS if k in decoding}
        if "top_p" in sampling and sampling["top_p"] == 0:
            raise ValueError("decoding.top_p=0: must be above 0 and at most 1 (1: every token)")
        alignments = decoding.get("alignments", False)
        if not isinstance(alignments, bool):
            raise ValueError(f"decoding.alignments={alignments!r}: give true or false")
        engine = decoding.get("engine", "auto")
        if engine not in ENGINES:
            raise ValueError(f"decoding.engine={engine!r}: choose one of {', '.join(ENGINES)}")
        scoring = decoding.get("scoring")
        if scoring is not None and scoring not in SCORINGS:
            raise ValueError(f"decoding.scoring={scoring!r}: choose one of {', '.join(SCORINGS)} (null: the model's)")
        early_stopping = decoding.get("early_stopping", False)
        if not _early_stopping(early_stopping):
            raise ValueError(f"decoding.early_stopping={early_stopping!r}: choose false, true or never")
        settings = cls(**values, sampling=sampling, alignments=alignments, engine=engine, scoring=scoring,
                       early_stopping=early_stopping)
        if settings.beam_size < 1:
            raise ValueError(f"decoding.beam_size={settings.beam_size}: must be at least 1")
        if not 1 <= settings.nbest <= settings.beam_size:
            raise ValueError(f"nbest={settings.nbest}: must be between 1 and the beam size ({settings.beam_size})")
        return settings

    def for_model(self, tested: Any, tested_scoring: Any = None, tested_early_stopping: Any = False) -> SearchSettings:
        """These settings for a model whose run tested with length penalty ``tested`` (its
        ``test_decoding.alpha``, read from the file: used only when a number from 0 to 10): a
        ``None`` alpha becomes the model's, or ``DEFAULT_ALPHA``; a ``None`` scoring becomes the
        model's ``test_decoding.scoring`` with its ``early_stopping`` (an imported folder's
        ``huggingface``, ``nmt.checkpoints.marian.decoding_of``), or ``gnmt``."""
        settings = self
        if settings.scoring is None:
            hf = tested_scoring == "huggingface"
            early = tested_early_stopping if _early_stopping(tested_early_stopping) else False
            settings = replace(settings, scoring="huggingface" if hf else "gnmt",
                               early_stopping=early if hf else settings.early_stopping)
        if settings.alpha is not None:
            return settings
        ok = isinstance(tested, (int, float)) and not isinstance(tested, bool) and 0 <= tested <= 10
        return replace(settings, alpha=float(tested) if ok else DEFAULT_ALPHA)

    def as_config(self) -> dict[str, Any]:
        """The settings as a ``decoding`` config (what ``/info`` shows)."""
        target = next(t for t, s in SEARCHES.items() if s == self.search)
        values = asdict(self)
        chosen = {k: values[k] if k in values else self.sampling.get(k) for k in KEYS[self.search]}
        return {"_target_": target, **{k: v for k, v in chosen.items() if v is not None}}


def _early_stopping(value: Any) -> bool:
    """Whether ``value`` is one of ``EARLY_STOPPING`` (booleans as booleans, not 0 or 1)."""
    return value is True or value is False or value == "never"


def _number(value: Any, kind: type, key: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            kind is int and value != int(value)):
        raise ValueError(f"{key}={value!r}: give a{'n integer' if kind is int else ' finite number'}")
    return kind(value)


def bounded(value: Any, key: str) -> int | float:
    """``decoding.<key>``'s value, of its type and within its ``BOUNDS``, or a one-line ValueError naming it."""
    kind, low, high = BOUNDS[key]
    number = _number(value, kind, f"decoding.{key}")
    if not low <= number <= high:
        raise ValueError(f"decoding.{key}={value!r}: must be from {low:,} to {high:,}")
    return number

"""The ``Translator`` interface (``nmt.inference.translator``) over a folder written by ``nmt-export
format=ctranslate2``: ``nmt-translate`` and ``nmt-serve`` take such a folder as ``ckpt=`` and
give the same output formats, n-best lists, scores and server API. Only ``ctranslate2`` and
``sentencepiece`` are imported: no torch on this path.

How it maps our decoding (``conf/decoding/*.yaml``) onto CTranslate2's ``translate_batch``:

- Sources are SentencePiece pieces of the folder's ``source.model`` (ids mapped to pieces, so an
  unknown character is ``<unk>`` as our UNK id), cut to the model's source limit with EOS, which
  CTranslate2 appends, as ``nmt.inference.translator`` does.
- Length cap: ours allows ``int(max_len_a * source_length + max_len_b)`` decoder steps (source
  length with EOS), the last one forced to EOS. CTranslate2 takes one ``max_decoding_length`` per
  call, so sentences are grouped by their cap and each group gets ``cap - 1`` steps: the same
  tokens (at the cap CTranslate2 stops instead of forcing EOS). ``min_decoding_length`` is 0, as ours.
- Length penalty: ours is GNMT's ``((5 + |Y|) / 6) ** alpha`` with |Y| counting EOS; CTranslate2
  divides by ``|Y| ** p``. ``p`` is ``alpha * n / (5 + n)``, n the mean source length of the
  chunk: the two penalties then grow alike around that length. Beam outputs can still differ
  (CTranslate2 also stops a sentence once ``beam_size`` hypotheses ended); greedy search gives
  the same tokens (tests/test_export_ctranslate2.py).
- ``scoring=huggingface`` (an imported folder's, kept by the export): transformers' ``|Y| ** alpha``
  is CTranslate2's own penalty, ``p = alpha``, with |Y| counting the forced tokens and EOS in both.
  CTranslate2 stops a sentence once ``beam_size`` hypotheses have ended: transformers'
  ``early_stopping=true``; with ``false`` or ``never`` transformers searches on while a live
  hypothesis could still win, which this backend does not (logged once). Right after a forced
  prefix CTranslate2 lets a hypothesis end only from the best candidate.
- Scores: CTranslate2 returns a hypothesis' summed log-probability (EOS included) divided by
  ``length ** p`` (length with EOS); ``logprob`` is that sum again, and ``score`` (beam search)
  the sum over GNMT's penalty (or ``|Y| ** alpha``), as ours. Its log-probabilities are renormalised
  over the vocabulary without PAD and BOS (the export gives them a -inf bias); ours and
  transformers' are a softmax over the whole vocabulary, so each of its log-probs is higher by
  ``-log(1 - p(PAD))``. A hypothesis stopped at its length cap has no EOS, so its ``logprob``
  lacks the forced EOS's that ours adds (except with ``scoring=huggingface``, where that EOS
  scores 0 and counts in the length as ours). Reading those log-probs back with ``score_batch``
  would cost a second pass over each sentence.
- Languages (a model that writes the target language as its first token: an imported M2M100,
  NLLB-200 or mBART-50, or a run fine-tuned from one; ``languages`` in ``nmt_export.json``):
  ``src_lang`` and ``tgt_lang`` are both required and checked as the torch backend checks them
  (``nmt.inference.requests``); the source code is a tag on the source (``<2de>``, cut into the
  model's ``▁<2de>``), the target code ``▁<2fr>`` CTranslate2's ``target_prefix``, cut from the
  output. CTranslate2 scores a forced token 0, as transformers' ``forced_bos_token_id`` and our
  ``scoring=huggingface`` beam search; ours keeps its log-prob in greedy search, sampling and
  ``scoring=gnmt``, where this backend's ``logprob`` is higher by it.
- Sampling: ``temperature``, ``top_k`` (0: all), ``top_p``; ``seed`` seeds CTranslate2's generator
  once per call, so a run is repeatable on the same batching.
- Attention: CTranslate2's alignment head (the export's last decoder layer, first head), not the
  average over heads that the torch backend returns.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt.inference.alignments import pharaoh
from nmt.data.tokenizer import LINE_BREAKING, check_vocabulary
from nmt.languages.tags import tag, tag_words, vocabulary_languages
from nmt.decoding.limits import tokens
from nmt.machine import usable_cores
from nmt.inference.requests import Naming, Request, RequestError, RequestMeaning
from nmt.decoding.settings import SCORINGS, SearchSettings
from nmt.inference.translations import Attention, Hypothesis, Translation, in_line_order

log = logging.getLogger(__name__)

METADATA = "nmt_export.json"  # written by nmt.exporters.ctranslate2
MAX_METADATA_BYTES = 1 << 20
# nmt.exporters.ctranslate2.DECODER_LANGUAGES: the source language a tag, the target one the decoder's first token
DECODER_LANGUAGES = {"source": "tag", "target": "decoder_prefix"}
EARLY_STOPPING = (False, True, "never")  # nmt.decoding.settings: scoring=huggingface's stopping rules
COMPUTE_TYPES = ("default", "auto", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                 "bfloat16", "float32")


def is_export(path: str | Path) -> bool:
    """Whether ``path`` is a CTranslate2 folder written by ``nmt-export``."""
    path = Path(path)
    return path.is_dir() and (path / METADATA).is_file() and (path / "model.bin").is_file()


def read_metadata(folder: Path) -> dict[str, Any]:
    """The folder's ``nmt_export.json``, checked: the limits and decoding defaults it must hold,
    of the expected types (a folder is data someone else wrote)."""
    path = folder / METADATA
    if path.stat().st_size > MAX_METADATA_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size:,} bytes, over {MAX_METADATA_BYTES:,}; not an nmt export")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e}); export the model again with nmt-export format=ctranslate2") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("decoding"), dict):
        raise ValueError(f"{path}: no decoding section; export the model again with nmt-export format=ctranslate2")
    for key in ("max_src_len", "max_tgt_len"):
        tokens(meta.get(key), key)
    decoding = meta["decoding"]
    for key in ("beam_size", "alpha", "max_len_a", "max_len_b"):
        value = decoding.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{path}: decoding.{key}={str(value)[:40]} is not a number >= 0")
    if decoding.get("scoring", "gnmt") not in SCORINGS or decoding.get("early_stopping", False) not in EARLY_STOPPING:
        raise ValueError(f"{path}: decoding.scoring={str(decoding.get('scoring'))[:40]}, early_stopping="
                         f"{str(decoding.get('early_stopping'))[:40]}: not one of {SCORINGS} and {EARLY_STOPPING}")
    if meta.get("languages") not in (None, DECODER_LANGUAGES):
        raise ValueError(f"{path}: languages={str(meta.get('languages'))[:80]}: this backend reads {DECODER_LANGUAGES} "
                         "or none; export the model again with nmt-export format=ctranslate2")
    return meta


def gnmt_penalty(length: int, alpha: float) -> float:
    """GNMT's length penalty ``((5 + length) / 6) ** alpha`` (``nmt.decoding.search.length_penalty``)."""
    return ((5.0 + length) / 6.0) ** alpha


def gnmt_slope(alpha: float, sources: list[list[str]]) -> float:
    """CTranslate2's length penalty closest to GNMT's: the exponent p of ``n ** p`` with the same
    slope in log space (``alpha * n / (5 + n)``) at the mean source length, a stand-in for the
    output length."""
    n = sum(len(s) + 1 for s in sources) / max(len(sources), 1)
    return alpha * n / (5 + n)


@dataclass(frozen=True)
class Scoring:
    """How one call searched and how the torch backend scores its hypotheses: ``alpha`` the torch
    backend's length penalty (0: none, greedy search and sampling), ``slope`` the exponent p of
    CTranslate2's ``length ** p`` it searched with, ``hf`` the penalty ``length ** alpha``
    (``scoring=huggingface``: then ``slope`` is ``alpha``) rather than GNMT's, ``lead`` the forced
    first target tokens (a target-language code)."""

    alpha: float
    slope: float
    hf: bool = False
    lead: int = 0

    def logprob(self, score: float, pieces: int, cap: int) -> float:
        """The summed log-prob of a hypothesis CTranslate2 scored ``score`` (its sum over
        ``length ** slope``; the length counts the forced tokens and EOS, and a hypothesis of
        ``pieces >= cap`` pieces stopped at its cap without EOS)."""
        counted = pieces if pieces >= cap else pieces + 1
        return score * counted**self.slope if self.slope else score

    def score(self, logprob: float, length: int) -> float:
        """The torch backend's score of a hypothesis of ``length`` tokens (forced ones and EOS included)."""
        if not self.alpha:
            return logprob
        return logprob / (length**self.alpha if self.hf else gnmt_penalty(length, self.alpha))


def decoding_cap(num_pieces: int, max_len_a: float, max_len_b: int, max_tgt_len: int) -> int:
    """CTranslate2's ``max_decoding_length`` for a source of ``num_pieces`` pieces (EOS not
    counted): our step cap ``int(a * (pieces + 1) + b)`` (at least 1) minus the forced-EOS step,
    within the decoder's position table."""
    steps = max(int(max_len_a * (num_pieces + 1) + max_len_b), 1)
    return min(steps - 1, max_tgt_len)


def default_workers() -> int:
    """Batches decoded at once: one per core this process may use (one thread each is
    CTranslate2's fastest setting on a small CPU)."""
    return usable_cores()


class CTranslate2Translator(RequestMeaning):
    """A CTranslate2 model folder with its SentencePiece models, limits and decoding defaults."""

    backend = "ctranslate2"

    def __init__(self, folder: str | Path, decoding: Any = None, device: str = "auto", compute_type: str = "default",
                 max_tokens: int = 2048, workers: int | None = None, intra_threads: int = 0) -> None:
        import ctranslate2
        import sentencepiece as spm

        self.folder = Path(folder)
        if not is_export(self.folder):
            raise ValueError(f"ckpt={folder}: not a CTranslate2 folder written by nmt-export "
                             f"(it needs {METADATA} and model.bin)")
        if compute_type not in COMPUTE_TYPES:
            raise ValueError(f"compute_type={compute_type}: choose one of {', '.join(COMPUTE_TYPES)}")
        self.meta = read_metadata(self.folder)
        defaults = self.meta["decoding"]
        if decoding is None:
            decoding = {"_target_": "nmt.decoding.search.beam_search", **defaults}
        settings = decoding if isinstance(decoding, SearchSettings) else SearchSettings.from_config(decoding)
        self.settings = settings.for_model(defaults.get("alpha"), defaults.get("scoring"),
                                           defaults.get("early_stopping", False))
        self.src_sp = spm.SentencePieceProcessor(model_file=str(self.folder / "source.model"))
        self.tgt_sp = spm.SentencePieceProcessor(model_file=str(self.folder / "target.model"))
        for sp, name in ((self.src_sp, "source.model"), (self.tgt_sp, "target.model")):
            check_vocabulary(sp, str(self.folder / name))
        self.target_languages = vocabulary_languages(self.src_sp)  # a multilingual model's <2xx> tags
        # an imported M2M100/NLLB-200/mBART-50's: src_lang a tag, tgt_lang the forced first target token
        self.decoder_languages = self.meta.get("languages") == DECODER_LANGUAGES
        if self.settings.scoring == "huggingface" and self.settings.early_stopping is not True:
            log.info("decoding.scoring=huggingface, early_stopping=%s: CTranslate2 stops a sentence once beam_size "
                     "hypotheses have ended, as transformers with early_stopping=true", self.settings.early_stopping)
        if device == "auto":
            device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
        self.device, self.compute_type = device, compute_type
        self.max_tokens = int(max_tokens)
        self.workers = int(workers or default_workers())
        self.translator = ctranslate2.Translator(str(self.folder), device=device, compute_type=compute_type,
                                                 inter_threads=self.workers, intra_threads=int(intra_threads))
        self.max_src_len, self.max_tgt_len = int(self.meta["max_src_len"]), int(self.meta["max_tgt_len"])
        self.step, self.report = self.meta.get("step"), None
        # older exports return the first head's attention only: no alignments from them
        self.can_align = self.meta.get("attention") == "last decoder layer, mean of all heads"
        self._ctranslate2 = ctranslate2

    # --- translating --------------------------------------------------------------------------
    def _pieces(self, lines: list[str], limit: int, numbers: list[int], what: str = "line") -> list[list[str]]:
        pieces = [[self.src_sp.id_to_piece(i) for i in ids] for ids in self.src_sp.encode(lines)] if lines else []
        cut = [n for n, p in zip(numbers, pieces) if len(p) > limit]
        if cut:
            log.warning("truncated %d %s(s) longer than %d tokens: %s", len(cut), what, limit, cut[:20])
        return [p[:limit] for p in pieces]

    def lead_ids(self, lang: str) -> list[int]:
        """The target ids an output in ``lang`` starts with: its language code (``▁<2xx>``), as the
        torch ``Translator.lead_ids``."""
        piece = f"\u2581{tag(lang)}"
        code = self.tgt_sp.piece_to_id(piece)
        if self.tgt_sp.id_to_piece(code) != piece:
            raise RequestError(f"tgt_lang={lang}: the target vocabulary has no {piece} piece")
        return [code]

    def batches(self, lines: list[str], beam_size: int | None = None, nbest: int | None = None,
                attention: Iterable[int] | bool = (), first_line: int = 1,
                alignments: bool | None = None, tgt_lang: str | None = None,
                src_lang: str | None = None) -> Iterator[list[tuple[int, Translation]]]:
        """As ``nmt.inference.translator.Translator.batches`` (no prefixes or constraints): the (index,
        ``Translation``) pairs of each group of sentences with one length cap, as soon as
        CTranslate2 has decoded it. A model that reads ``src_lang`` and ``tgt_lang`` gets the
        target code as CTranslate2's ``target_prefix``, cut from the output."""
        prepared = self.prepare(Request(lines, tgt_lang, src_lang=src_lang),
                                Naming(numbers=range(first_line, first_line + len(lines))))
        lines, lead = prepared.sources, [self.tgt_sp.id_to_piece(i) for i in prepared.lead]
        s = self.settings
        align = s.alignments if alignments is None else alignments
        if align and not self.can_align:
            raise ValueError(f"decoding.alignments=true: {self.folder} was exported before nmt-export kept every head's "
                             "attention; export it again with nmt-export format=ctranslate2")
        beam_size = s.beam_size if beam_size is None else int(beam_size)
        nbest = s.nbest if nbest is None else int(nbest)
        sampling = s.search == "sample" and beam_size == s.beam_size
        todo = [i for i, line in enumerate(lines) if line.strip()]
        wanted = set(todo) if attention is True else set(attention or ())
        sources = self._pieces([lines[i] for i in todo], self.max_src_len - 1, [first_line + i for i in todo])
        groups: dict[int, list[int]] = {}
        for j, source in enumerate(sources):
            groups.setdefault(decoding_cap(len(source), s.max_len_a, s.max_len_b, self.max_tgt_len), []).append(j)
        beam = (beam_size > 1 or nbest > 1) and not sampling
        alpha = s.alpha if beam else 0.0
        hf = beam and s.scoring == "huggingface"  # score / length ** alpha: CTranslate2's own length penalty
        slope = alpha if hf else gnmt_slope(alpha, sources) if alpha else 0.0
        options: dict[str, Any] = {"beam_size": beam_size, "num_hypotheses": nbest, "return_scores": True,
                                   "length_penalty": slope}
        if sampling:
            options = {"beam_size": 1, "num_hypotheses": 1, "return_scores": True,
                       "sampling_topk": int(s.sampling.get("top_k", 0)),
                       "sampling_topp": float(s.sampling.get("top_p", 1.0)),
                       "sampling_temperature": float(s.sampling.get("temperature", 1.0)) or 1.0}
            slope = 0.0
            if float(s.sampling.get("temperature", 1.0)) <= 0:  # temperature 0: greedy, as sample_search
                options["sampling_topk"] = 1
            self._ctranslate2.set_random_seed(int(s.sampling.get("seed", 0)))
        scoring = Scoring(alpha, slope, hf, len(lead))
        pending = []
        for cap, rows in groups.items():
            if cap <= len(lead):  # only the forced tokens and EOS fit: an empty translation
                pending.append((rows, None, False, cap))
                continue
            with_attention = align or any(todo[j] in wanted for j in rows)
            batch = [sources[j] for j in rows]
            prefix = {"target_prefix": [lead] * len(rows)} if lead else {}  # scored 0, as transformers' forced code
            results = self.translator.translate_batch(
                batch, max_decoding_length=cap, min_decoding_length=0, max_input_length=0,
                max_batch_size=self.max_tokens, batch_type="tokens", asynchronous=True,
                return_attention=with_attention, **prefix, **options)
            pending.append((rows, results, with_attention, cap))
        for rows, results, with_attention, cap in pending:
            out = []
            for k, j in enumerate(rows):
                result = results[k].result() if results is not None else None
                out.append((todo[j], self._translation(result, sources[j], scoring, cap,
                                                       with_attention and todo[j] in wanted, align)))
            yield out

    def _translation(self, result: Any, source: list[str], scoring: Scoring, cap: int, with_attention: bool,
                     align: bool = False) -> Translation:
        """One sentence's result; ``scoring`` how CTranslate2 searched and how the torch backend scores,
        ``cap`` its ``max_decoding_length`` (a hypothesis of that many pieces, forced ones included,
        stopped there without EOS)."""
        if result is None:
            return Translation([Hypothesis("", 0.0, 0.0)])
        hypotheses, lead = [], scoring.lead
        for pieces, score in zip(result.hypotheses, result.scores):
            logprob = scoring.logprob(float(score), len(pieces), cap)
            text = LINE_BREAKING.sub(" ", self.tgt_sp.decode([self.tgt_sp.piece_to_id(p) for p in pieces[lead:]]))
            hypotheses.append(Hypothesis(text, scoring.score(logprob, len(pieces) + 1), logprob))
        outputs = [pieces[lead:] for pieces in result.hypotheses]
        weights = [rows[lead:] for rows in result.attention or []]
        if align:  # each hypothesis' attention, as the torch backend's teacher-forced pass reads it
            for hypothesis, pieces, rows in zip(hypotheses, outputs, weights):
                hypothesis.alignment = pharaoh(source, pieces, [row[: len(source)] for row in rows[: len(pieces)]],
                                               skip=tag_words(source) if self.target_languages else 0)
        attention = None
        if with_attention and weights:
            attention = Attention(source + ["</s>"], outputs[0] + ["</s>"], [list(map(float, row)) for row in weights[0]])
        return Translation(hypotheses, attention)

    def translate(self, lines: list[str], beam_size: int | None = None, nbest: int | None = None,
                  attention: Iterable[int] | bool = (), alignments: bool | None = None,
                  tgt_lang: str | None = None, src_lang: str | None = None) -> list[Translation]:
        return in_line_order(self.batches(lines, beam_size, nbest, attention, alignments=alignments, tgt_lang=tgt_lang,
                                          src_lang=src_lang), len(lines), Translation)

    # --- scoring ------------------------------------------------------------------------------
    def score_batches(self, sources: list[str], targets: list[str], first_line: int = 1,
                      lead: list[int] | None = None) -> Iterator[list[tuple[int, list[float]]]]:
        """Per-token log-probabilities (EOS last) of each target given its source, through
        CTranslate2's ``score_batch``; ``lead``: target ids every target starts with
        (``Prepared.lead``: a target-language code), read but not scored."""
        todo = [i for i, s in enumerate(sources) if s.strip()]
        numbers = [first_line + i for i in todo]
        src = self._pieces([sources[i] for i in todo], self.max_src_len - 1, numbers)
        first = [self.tgt_sp.id_to_piece(i) for i in lead or []]
        tgt = [[self.tgt_sp.id_to_piece(i) for i in ids] for ids in self.tgt_sp.encode([targets[i] for i in todo])]
        limit = self.max_tgt_len - 1 - len(first)
        cut = [n for n, t in zip(numbers, tgt) if len(t) > limit]
        if cut:
            log.warning("truncated %d line(s) longer than %d tokens: %s", len(cut), limit, cut[:20])
        tgt = [first + t[:limit] for t in tgt]
        if not todo:
            return
        results = self.translator.score_batch(src, tgt, max_batch_size=self.max_tokens, batch_type="tokens",
                                              max_input_length=0)
        yield [(i, [float(v) for v in r.log_probs[len(first):]]) for i, r in zip(todo, results)]

    def score(self, sources: list[str], targets: list[str], lead: list[int] | None = None) -> list[list[float] | None]:
        return in_line_order(self.score_batches(sources, targets, lead=lead), len(sources), lambda: None)

    # --- describing ---------------------------------------------------------------------------
    has_attention = True

    def count_tokens(self, texts: list[str]) -> int:
        return sum(len(ids) + 1 for ids in self.src_sp.encode(texts)) if texts else 0

    def info(self) -> dict[str, Any]:
        run = self.meta.get("run") if isinstance(self.meta.get("run"), dict) else {}
        return {
            "backend": self.backend,
            "preset": {"encoder": "TransformerEncoder", "decoder": "TransformerDecoder"},
            "hidden_size": run.get("hidden_size"), "parameters": run.get("parameters"),
            "src_lang": self.meta.get("src_lang"), "tgt_lang": self.meta.get("tgt_lang"),
            "target_languages": self.target_languages,
            "reads_src_lang": self.decoder_languages,  # an imported M2M100/NLLB-200/mBART-50: requests name both
            "src_vocab_size": self.src_sp.get_piece_size(), "tgt_vocab_size": self.tgt_sp.get_piece_size(),
            "max_src_len": self.max_src_len, "attention": self.has_attention,
            "decoding": self.settings.as_config(), "precision": self.compute_type,
            "run": run.get("task_name"), "step": self.step, "tags": run.get("tags"),
        }

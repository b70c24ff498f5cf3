"""Serve a model over HTTP: ``nmt-serve ckpt=<checkpoint or release file> [host= port= precision=
decoding=...]`` (see ``nmt/conf/serve.yaml``).

``POST /translate`` ``{"text": [...], "beam_size"?, "nbest"?, "attention"?, "alignments"?}`` returns
``{"translations": [{"text", "score", "alignment"?, "nbest"?, "attention"?, "heads"?}, ...]}`` in request order
(``"attention": "heads"``: each cross-attention head's weights too, and the sentence's per-head table); concurrent
requests are decoded together (``nmt.serve.batching``) by the translator ``nmt-translate`` uses
(``nmt.inference.backends``: a checkpoint, a release file or a CTranslate2 folder), so a sentence gets the
translation ``translate.py`` gives it with the same decoding. ``GET /health``,
``GET /info`` (model, languages, vocabularies, training summary), ``GET /`` (a page to try the
model), ``GET /report.png`` (the run's BLEU-by-length chart, when the checkpoint's run has one).
Bad input is a 400 naming what is wrong; over a limit (``limits.*``) a 413 or 429 naming the limit;
what a request must be before it is read (API key, content type, size, time) is ``nmt.serve.guard``.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from concurrent.futures import ProcessPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from omegaconf import DictConfig, ListConfig, OmegaConf

from nmt import register_resolvers
from nmt.cli_io import hydra_command, stop_within_grace
from nmt.decoding.settings import BOUNDS
from nmt.inference.backends import open_translator
from nmt.inference.requests import Naming, Request as TranslationRequest
from nmt.serve.batching import Batcher, ClientGone, QueueFull, QueueTimeout
from nmt.serve.guard import (AmbiguousLengthMiddleware, ApiKeyMiddleware, HeaderTimeoutH11Protocol, content_type_error,
                             error, max_body_bytes, parse_request, read_body)
from nmt.inference.translations import response_item

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"


@dataclass(frozen=True, eq=False)
class Guide:
    """A request's prefixes or constraints, one per sentence: compared by identity, so a guided
    request decodes in a call of its own (its guides stay in line with its sentences)."""

    rows: tuple[tuple[str, tuple[str, ...]], ...]


def naming(count: int) -> Naming:
    """How the server names a request's parts in its errors: sentences from 0, the JSON fields."""
    return Naming(numbers=range(count), item="sentence", tgt_lang="tgt_lang", src_lang="src_lang", prefixes='"prefix"',
                  constraints='"constraints"')


def answer(translator: Any, texts: list[str], options: tuple[Any, ...]) -> list[dict[str, Any]]:
    """The ``translations`` of a request: ``options`` are its (beam_size, nbest, attention,
    alignments, guide, languages); ``languages``: (src_lang, tgt_lang) of a model that reads them
    itself (an imported M2M100/NLLB-200, ``texts`` untagged), else None."""
    beam_size, nbest, attention, alignments, guide, languages = options
    extra: dict[str, Any] = {"alignments": bool(alignments)}  # parse_request refused it where the translator cannot
    if languages:
        extra["src_lang"], extra["tgt_lang"] = languages
    if guide is not None:
        if any(prefix for prefix, _ in guide.rows):
            extra["prefixes"] = [prefix for prefix, _ in guide.rows]
        else:
            extra["constraints"] = [list(phrases) for _, phrases in guide.rows]
    translations = translator.translate(texts, beam_size, nbest, attention=bool(attention), **extra)
    items = [response_item(t, nbest, attention) for t in translations]
    if attention == "heads":  # each layer's and head's cross-attention, and the sentence's per-head table
        from nmt.evaluation.heads import sentence_heads
        for t, item in zip(translations, items):
            if t.attention is not None:
                heads = sentence_heads(translator, t.attention.source, t.attention.target)
                item["attention"]["heads"], item["heads"] = heads["weights"], heads["table"]
    return items


WEIGHTS_PER_UNIT = 16  # attention weights (kept by the search, aligned, sent) that cost one unit of decoding work


def decoding_work(lengths: list[int], beam_size: int, constraints: list[int] | None = None, nbest: int = 1,
                  attention: bool | str = False, alignments: bool = False,
                  target_cap: Callable[[int], int] | None = None, heads: int = 0) -> int:
    """What a request costs, in units the server bounds (``limits.max_work``), summed over its
    sentences of ``n`` source tokens and at most ``t = target_cap(n)`` target tokens: the search,
    ``n`` x beam size x (1 + constraints) (constrained search keeps a bank of hypotheses per
    constraint met); the n-best texts, nbest x ``t``; with ``attention``, the search keeps every
    beam's weights and the reply carries the best one's, beam x ``t`` x ``n`` weights; with
    ``alignments``, each of the nbest hypotheses is scored again and aligned from its own
    ``t`` x ``n`` weights; with ``attention="heads"``, the reply also carries ``t`` x ``n``
    weights of each of the model's ``heads`` cross-attention heads (all layers). Weights count
    ``WEIGHTS_PER_UNIT`` to the unit. Time, memory and reply bytes grow with this."""
    counts = constraints or [0] * len(lengths)
    cap = target_cap or (lambda n: int(1.5 * n) + 10)
    work = 0
    for n, c in zip(lengths, counts):
        t = cap(n)
        weights = ((int(beam_size) * t * n if attention else 0) + (int(nbest) * t * n if alignments else 0)
                   + (heads * t * n if attention == "heads" else 0))
        work += n * int(beam_size) * (1 + c) + int(nbest) * t + -(-weights // WEIGHTS_PER_UNIT)
    return work


def cross_heads(translator: Any) -> int:
    """The cross-attention heads of the translator's model, all layers (0: an RNN decoder, an
    ensemble or a CTranslate2 folder, whose heads the page cannot show)."""
    if getattr(translator, "backend", None) != "torch":  # a CTranslate2 translator imports no torch
        return 0
    from nmt.evaluation.heads import has_heads
    from nmt.models.head_mask import head_counts

    model = getattr(translator, "model", None)
    if model is None or not has_heads(model):
        return 0
    return sum(head_counts(model).get("cross", []))


def target_cap(translator: Any, source_tokens: int) -> int:
    """The most target tokens (EOS included) the translator decodes for a source of ``source_tokens``."""
    s = translator.settings
    return max(1, min(int(s.max_len_a * source_tokens) + int(s.max_len_b), int(translator.max_tgt_len)))


def describe(translator: Any) -> dict[str, Any]:
    """``/info``'s model part. What comes from the checkpoint or export is data someone else
    wrote: only finite numbers and short strings of it are passed on."""
    facts = translator.info()
    tags = facts.get("tags")
    summary: dict[str, Any] = {"run": text(facts.get("run")), "step": number(facts.get("step")),
                               "tags": [text(t) for t in tags[:20]] if isinstance(tags, list) else text(tags)}
    if translator.report is not None:
        summary.update(report_summary(translator.report["summary"]))
    return {
        "backend": facts["backend"], "preset": facts["preset"], "members": number(facts.get("members", 1)),
        "hidden_size": number(facts.get("hidden_size")),
        "parameters": number(facts.get("parameters")),
        "src_lang": text(facts.get("src_lang")), "tgt_lang": text(facts.get("tgt_lang")),
        "src_vocab_size": facts["src_vocab_size"], "tgt_vocab_size": facts["tgt_vocab_size"],
        "max_src_len": facts["max_src_len"], "target_languages": facts["target_languages"][:1000],  # codes: <2xx> pieces
        "reads_src_lang": facts.get("reads_src_lang") is True,  # requests give "src_lang" and "tgt_lang"
        "attention": facts["attention"], "heads": cross_heads(translator), "decoding": facts["decoding"],
        "precision": facts["precision"], "training": summary, "report": translator.report is not None,
    }


def number(value: Any) -> float | int | None:
    """``value`` if it is a finite number (JSON has no NaN), else None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def text(value: Any, limit: int = 200) -> str | None:
    """``value`` if it is a string, cut to ``limit`` characters, else None."""
    return value[:limit] if isinstance(value, str) else None


def report_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Test BLEU, chrF, sentence count and per-length BLEU of a run's report: values of the
    expected types only (a release file's report is data someone else wrote)."""
    buckets = report.get("buckets") if isinstance(report.get("buckets"), list) else []
    return {"test_bleu": number(report.get("bleu")), "test_chrf": number(report.get("chrf")),
            "test_sentences": number(report.get("count")),
            "bleu_by_length": [{"label": text(b.get("label"), 40), "count": number(b.get("count")),
                                "bleu": number(b.get("bleu"))} for b in buckets[:100] if isinstance(b, dict)]}


# --- the decoding process (batching.process=true) -------------------------------------------------
_worker: Any = None


def _load_worker(cfg: dict[str, Any]) -> None:
    global _worker
    register_resolvers()  # a spawned process: nothing of the server's set-up is here
    _worker = load(OmegaConf.create(cfg))
    parent = os.getppid()

    def exit_with_parent() -> None:  # a killed server leaves no decoding process behind
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()


def _worker_translate(texts: list[str], options: tuple[Any, ...]) -> list[dict[str, Any]]:
    return answer(_worker, texts, options)


def create_app(translator: Any, cfg: DictConfig) -> FastAPI:
    """The FastAPI app serving ``translator`` with the batching and limits of ``cfg`` (serve.yaml).
    With ``batching.process``, a second copy of the model decodes in a process of its own, so the
    event loop answering requests never waits for the GIL behind a decoding step."""
    limits = cfg.limits
    check_limits(limits)
    if cfg.batching.process:
        keys = ("ckpt", "backend", "allow_pickle", "device", "kernels", "precision", "max_tokens", "workers", "decoding",
                "ctranslate2")
        worker_cfg = {k: OmegaConf.to_container(cfg[k]) if isinstance(cfg[k], (DictConfig, ListConfig)) else cfg[k]
                      for k in keys if k in cfg}
        restart = functools.partial(ProcessPoolExecutor, 1, mp_context=multiprocessing.get_context("spawn"),
                                    initializer=_load_worker, initargs=(worker_cfg,))  # again if its process dies
        executor, decode = restart(), _worker_translate
    else:
        executor, decode, restart = None, functools.partial(answer, translator), None
    batcher = Batcher(decode, cfg.batching.max_wait_ms, cfg.batching.max_batch_tokens, limits.max_queue, executor,
                      cfg.batching.max_gather_ms, limits.get("max_queue_s"), restart)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await batcher.run(len, "")  # the decoding process has loaded the model before the first request
        batcher.start()
        yield
        await batcher.stop()

    docs = {} if cfg.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}  # Swagger UI: a CDN's scripts
    app = FastAPI(title="nmt", lifespan=lifespan, **docs)
    app.state.batcher, app.state.translator = batcher, translator
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    if (key := api_key(cfg)) is not None:
        app.add_middleware(ApiKeyMiddleware, key=key)
    app.add_middleware(AmbiguousLengthMiddleware)
    if cfg.cors_origins:  # added last, so it runs first: preflights and 401s carry its headers
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-API-Key"])
    max_body = max_body_bytes(limits)

    @app.post("/translate")
    async def translate(request: Request):
        body = content_type_error(request) or await read_body(request, max_body, float(limits.read_timeout_s))
        if isinstance(body, JSONResponse):
            return body
        parsed = parse_request(body, limits, translator.settings.beam_size, getattr(translator, "can_align", True),
                               translator.settings.alignments, cfg.get("tgt_lang"), cfg.get("src_lang"))
        if isinstance(parsed, JSONResponse):
            return parsed
        asked, options = parsed
        try:  # what the request means for this model, checked before any decoding: a 400 naming the sentence
            texts = translator.prepare(asked, naming(len(asked.texts))).sources
        except (ValueError, RuntimeError) as e:  # RuntimeError: sentencepiece on text it cannot take
            return error(400, str(e))
        guide = None
        if any(asked.prefixes or ()) or any(asked.constraints or ()):  # "" and [] mean none
            guide = Guide(tuple(zip(asked.prefixes or [""] * len(texts),
                                    (tuple(c) for c in asked.constraints or [()] * len(texts)))))
        # a model that reads src_lang/tgt_lang itself (an imported M2M100/NLLB-200) decodes the untagged texts
        languages = (asked.src_lang, asked.tgt_lang) if getattr(translator, "decoder_languages", False) else None
        options = (*options, guide, languages)
        lengths = [translator.count_tokens([t]) for t in texts]
        if languages:
            texts = list(asked.texts)
        head_count = cross_heads(translator) if options[2] == "heads" else 0
        if options[2] == "heads" and not head_count:
            return error(400, '"attention": "heads": this model has no attention heads to show (heads are a Transformer '
                              'decoder\'s, read from a checkpoint or release file); ask for "attention": true')
        work = decoding_work(lengths, options[0], [len(c) for c in asked.constraints] if asked.constraints else None,
                             nbest=options[1], attention=options[2], alignments=options[3],
                             target_cap=functools.partial(target_cap, translator), heads=head_count)
        if limits.get("max_work") is not None and work > limits.max_work:
            return error(413, f"the request asks for {work:,} units of work (source tokens x beam size x (1 + "
                              f"constraints), n-best tokens, attention and alignment weights / {WEIGHTS_PER_UNIT}, "
                              f"summed over its sentences); the limit is max_work={limits.max_work:,}: send fewer or "
                              "shorter sentences, a smaller beam or n-best list, fewer constraints, or leave out "
                              "attention and alignments", "max_work", limits.max_work)
        try:
            results = await batcher.submit(texts, options, sum(lengths), gone=request.is_disconnected)
        except QueueFull:
            return error(429, f"{limits.max_queue} requests are waiting; the limit is max_queue={limits.max_queue}; "
                              "retry later", "max_queue", limits.max_queue)
        except QueueTimeout as e:
            return error(503, f"the request waited {e.waited:.1f} s for the decoder; the limit is max_queue_s={e.limit:g}; "
                              "retry later", "max_queue_s", e.limit)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the client closed the connection
        except Exception as e:  # noqa: BLE001  this request's own failure: the others of its batch were answered
            return error(500, f"decoding this request failed ({type(e).__name__}); the server's log has the details")
        return {"translations": results}

    @app.get("/health")
    async def health():
        return {"status": "ok", "queue": batcher.pending(), **batcher.stats}

    @app.get("/info")
    async def info():
        return {**describe(translator), "limits": OmegaConf.to_container(limits),
                "batching": OmegaConf.to_container(cfg.batching)}

    @app.get("/report.png")
    async def report_png():
        png = translator.report["png"] if translator.report is not None else None
        if png is None:
            return error(404, "no BLEU-by-length chart: the checkpoint's run has no bleu_by_length.png")
        return Response(png, media_type="image/png", headers={"X-Content-Type-Options": "nosniff"})

    @app.get("/")
    async def index():
        return FileResponse(STATIC / "index.html")

    return app


def check_limits(limits: DictConfig) -> None:
    """The server's limits, checked at start: whole numbers of at least 1 (``max_work`` may be
    null, ``max_queue`` 0: every request a 429), and a ``max_beam_size`` the search takes."""
    for key in ("max_chars", "max_sentences", "max_queue", "max_work", "max_beam_size", "max_header_bytes",
                "max_connections"):
        value = limits.get(key)
        if value is None and key == "max_work":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < (key != "max_queue"):
            raise ValueError(f"limits.{key}={value!r}: a positive whole number")
    top = BOUNDS["beam_size"][2]
    if limits.max_beam_size > top:
        raise ValueError(f"limits.max_beam_size={limits.max_beam_size}: at most {top} (decoding.beam_size's bound)")


def api_key(cfg: DictConfig) -> str | None:
    """``api_key`` (``NMT_SERVE_API_KEY`` by default), checked: printable ASCII, not empty."""
    key = cfg.get("api_key")
    if key is None:
        return None
    key = str(key)
    if not key or not key.isascii() or not key.isprintable() or key != key.strip():
        raise ValueError("api_key (or NMT_SERVE_API_KEY) must be printable ASCII without spaces at its ends; "
                         "leave it null to serve without a key")
    return key


def load(cfg: DictConfig) -> Any:
    """The translator of ``cfg`` (``nmt.inference.backends``); its attention is probed once, at start."""
    translator = open_translator(cfg)
    if cfg.get("tgt_lang") is not None or cfg.get("src_lang") is not None:  # requests' default languages: the model's
        langs = {key: None if cfg.get(key) is None else str(cfg.get(key)) for key in ("tgt_lang", "src_lang")}
        if getattr(translator, "decoder_languages", False):  # each a code of the model; a request may give the other
            for key, lang in langs.items():
                if lang is not None and lang not in translator.target_languages:
                    raise ValueError(f"{key}={lang[:40]}: unknown language code; this model knows "
                                     f"{', '.join(translator.target_languages)}")
        else:
            translator.prepare(TranslationRequest([], langs["tgt_lang"], src_lang=langs["src_lang"]))
    translator.has_attention  # noqa: B018  (the probe decodes one sentence: before the first request)
    return translator


def serve(cfg: DictConfig) -> None:
    """Load the model ``cfg`` names and serve it on ``cfg.host``:``cfg.port`` until stopped."""
    import uvicorn

    with stop_within_grace():  # a signal during the model's load stops nmt-serve within the grace
        translator = load(cfg)
    app = create_app(translator, cfg)
    limits = cfg.limits
    log.info("serving %s on http://%s:%d", cfg.ckpt, cfg.host, cfg.port)
    uvicorn.run(app, host=cfg.host, port=int(cfg.port), log_level=cfg.log_level,
                http=functools.partial(HeaderTimeoutH11Protocol, header_timeout_s=float(limits.header_timeout_s)),
                h11_max_incomplete_event_size=int(limits.max_header_bytes), timeout_keep_alive=int(limits.keep_alive_s),
                limit_concurrency=int(limits.max_connections), timeout_graceful_shutdown=int(cfg.shutdown_timeout_s))


main = hydra_command("serve", serve)  # nmt-serve: nmt/conf/serve.yaml

if __name__ == "__main__":
    main()

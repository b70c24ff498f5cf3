"""Serve a model over HTTP: ``nmt-serve ckpt=<checkpoint or release file> [host= port= precision=
decoding=...]`` (see ``nmt/conf/serve.yaml``).

``POST /translate`` ``{"text": [...], "beam_size"?, "nbest"?, "attention"?}`` returns
``{"translations": [{"text", "score", "nbest"?, "attention"?}, ...]}`` in request order; concurrent
requests are decoded together (``nmt.serve.batching``) with ``nmt.translate``'s functions, so a
sentence gets the translation ``translate.py`` gives it with the same decoding. ``GET /health``,
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
from concurrent.futures import ProcessPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import hydra
import torch
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from nmt import CONF_DIR, register_resolvers
from nmt.cli_io import ending_cleanly
from nmt.checkpoint import Loaded, load_checkpoint
from nmt.data.tokenizer import EOS
from nmt.decoding import beam_search, greedy_search
from nmt.serve.batching import Batcher, QueueFull
from nmt.serve.guard import (ApiKeyMiddleware, HeaderTimeoutH11Protocol, content_type_error, error, parse_request,
                             read_body)
from nmt.translate import decode_batches, model_max_src_len, prepare_model

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"


class Translator:
    """A loaded model and its decoding: ``translate(texts, (beam_size, nbest, attention))``."""

    def __init__(self, loaded: Loaded, decoding: DictConfig, precision: str = "32", max_tokens: int = 2048,
                 workers: int | None = None) -> None:
        self.loaded, self.precision, self.max_tokens, self.workers = loaded, str(precision), int(max_tokens), workers
        self.model = prepare_model(loaded.model, self.precision)
        self.src_vocab, self.tgt_vocab = loaded.src_vocab, loaded.tgt_vocab
        self.max_src_len = model_max_src_len(loaded.run_config)
        self.decoding = OmegaConf.to_container(decoding)
        self.default_search = instantiate(decoding)
        self.default_beam = int(self.decoding.get("beam_size", 1)) if "beam_search" in self.decoding["_target_"] else 1
        self.report = loaded.report  # the run folder's or the release file's, never a path from the config
        self.has_attention = bool(self.translate(["a"], (self.default_beam, 1, True))[0].get("attention"))

    def search(self, beam_size: int, nbest: int):
        """The configured decoding, or beam search (greedy for a beam of 1) with its length limits."""
        if beam_size == self.default_beam and nbest == int(self.decoding.get("nbest", 1) or 1):
            return self.default_search
        limits = {k: self.decoding[k] for k in ("max_len_a", "max_len_b") if k in self.decoding}
        if beam_size == 1:
            return lambda *a, **kw: greedy_search(*a, **limits, **kw)
        alpha = float(self.decoding.get("alpha", 0.6))
        return lambda *a, **kw: beam_search(*a, beam_size=beam_size, alpha=alpha, nbest=nbest, **limits, **kw)

    def translate(self, texts: list[str], options: tuple[int, int, bool]) -> list[dict[str, Any]]:
        beam_size, nbest, attention = options
        out: list[dict[str, Any]] = [{"text": "", "score": 0.0} for _ in texts]
        if nbest > 1:
            for row in out:
                row["nbest"] = []
        wanted = range(len(texts)) if attention else ()
        for rows, hyps, sources in decode_batches(self.model, self.src_vocab, texts, self.search(beam_size, nbest),
                                                  self.max_tokens, self.max_src_len, wanted, self.precision,
                                                  self.workers):
            for r, i in enumerate(rows):
                out[i] = {"text": self.tgt_vocab.decode(hyps.tokens[r]), "score": round(float(hyps.scores[r]), 4)}
                if nbest > 1 and hyps.nbest is not None:
                    out[i]["nbest"] = [{"text": self.tgt_vocab.decode(t), "score": round(float(s), 4)}
                                       for t, s in hyps.nbest[r]]
                if attention and hyps.attn is not None:
                    weights = hyps.attn[r][:, : len(sources[r])]  # (T, S)
                    out[i]["attention"] = {"source": self.src_vocab.pieces(sources[r]),
                                           "target": self.tgt_vocab.pieces(hyps.tokens[r] + [EOS]),
                                           "weights": [[round(w, 4) for w in row] for row in weights.tolist()]}
        return out

    def info(self) -> dict[str, Any]:
        """The model, its training and the serving settings. What comes from the checkpoint is data
        someone else wrote: only finite numbers and short strings of it are passed on."""
        rc = self.loaded.run_config
        model_cfg, data = rc.get("model", {}), rc.get("data", {})
        tags = rc.get("tags")
        summary: dict[str, Any] = {"run": text(rc.get("task_name")), "step": number(self.loaded.step),
                                   "tags": [text(t) for t in tags[:20]] if isinstance(tags, list) else text(tags)}
        if self.report is not None:
            summary.update(report_summary(self.report["summary"]))
        return {
            "preset": {part: type(getattr(self.loaded.model, part)).__name__ for part in ("encoder", "decoder")},
            "hidden_size": number(model_cfg.get("hidden_size")),
            "parameters": sum(p.numel() for p in self.loaded.model.parameters()),
            "src_lang": text(data.get("src_lang")), "tgt_lang": text(data.get("tgt_lang")),
            "src_vocab_size": self.src_vocab.vocab_size, "tgt_vocab_size": self.tgt_vocab.vocab_size,
            "max_src_len": self.max_src_len, "attention": self.has_attention,
            "decoding": self.decoding, "precision": self.precision,
            "training": summary, "report": self.report is not None,
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
_worker: Translator | None = None


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


def _worker_translate(texts: list[str], options: tuple[int, int, bool]) -> list[dict[str, Any]]:
    return _worker.translate(texts, options)


def create_app(translator: Translator, cfg: DictConfig) -> FastAPI:
    """The FastAPI app serving ``translator`` with the batching and limits of ``cfg`` (serve.yaml).
    With ``batching.process``, a second copy of the model decodes in a process of its own, so the
    event loop answering requests never waits for the GIL behind a decoding step."""
    limits = cfg.limits
    if cfg.batching.process:
        keys = ("ckpt", "allow_pickle", "device", "precision", "max_tokens", "workers", "decoding")
        worker_cfg = {k: OmegaConf.to_container(cfg[k]) if k == "decoding" else cfg[k] for k in keys}
        executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_load_worker,
                                       initargs=(worker_cfg,))
        decode = _worker_translate
    else:
        executor, decode = None, translator.translate
    batcher = Batcher(decode, cfg.batching.max_wait_ms, cfg.batching.max_batch_tokens, limits.max_queue, executor,
                      cfg.batching.max_gather_ms)

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
    if cfg.cors_origins:  # added last, so it runs first: preflights and 401s carry its headers
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-API-Key"])
    max_body = limits.max_sentences * (limits.max_chars * 6 + 8) + 1024  # JSON escapes: at most 6 bytes a character

    @app.post("/translate")
    async def translate(request: Request):
        body = content_type_error(request) or await read_body(request, max_body, float(limits.read_timeout_s))
        if isinstance(body, JSONResponse):
            return body
        parsed = parse_request(body, limits, translator.default_beam)
        if isinstance(parsed, JSONResponse):
            return parsed
        texts, options = parsed
        tokens = sum(len(ids) + 1 for ids in translator.src_vocab.encode_batch(texts)) if texts else 0
        try:
            results = await batcher.submit(texts, options, tokens)
        except QueueFull:
            return error(429, f"{limits.max_queue} requests are waiting; the limit is max_queue={limits.max_queue}; "
                              "retry later", "max_queue", limits.max_queue)
        return {"translations": results}

    @app.get("/health")
    async def health():
        return {"status": "ok", "queue": batcher.pending(), **batcher.stats}

    @app.get("/info")
    async def info():
        return {**translator.info(), "limits": OmegaConf.to_container(limits),
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


def load(cfg: DictConfig) -> Translator:
    gpu = torch.cuda.is_available() and str(cfg.precision) != "int8"
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if gpu else "cpu"))
    loaded = load_checkpoint(cfg.ckpt, device=device, allow_pickle=cfg.allow_pickle)
    loaded.model.set_kernels(cfg.get("kernels", "auto"))
    return Translator(loaded, cfg.decoding, cfg.precision, cfg.max_tokens, cfg.workers)


def main() -> None:
    """``nmt-serve``: the config resolvers, then Hydra composes and runs ``run``."""
    register_resolvers()
    run()


@hydra.main(config_path=CONF_DIR, config_name="serve", version_base="1.3")
@ending_cleanly()  # a user's error: one line on stderr, status 1
def run(cfg: DictConfig) -> None:
    import uvicorn

    app = create_app(load(cfg), cfg)
    limits = cfg.limits
    log.info("serving %s on http://%s:%d", cfg.ckpt, cfg.host, cfg.port)
    uvicorn.run(app, host=cfg.host, port=int(cfg.port), log_level=cfg.log_level,
                http=functools.partial(HeaderTimeoutH11Protocol, header_timeout_s=float(limits.header_timeout_s)),
                h11_max_incomplete_event_size=int(limits.max_header_bytes), timeout_keep_alive=int(limits.keep_alive_s),
                limit_concurrency=int(limits.max_connections), timeout_graceful_shutdown=int(cfg.shutdown_timeout_s))


if __name__ == "__main__":
    main()

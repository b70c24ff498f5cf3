"""What ``nmt-serve`` accepts from a client, checked before anything turns into work.

- ``AmbiguousLengthMiddleware``: a request with both Content-Length and Transfer-Encoding is
  answered with ``Connection: close``, so nothing after it on the connection is read.
- ``ApiKeyMiddleware``: with ``api_key`` set, every path but ``/health``, ``/`` and ``/static/``
  needs ``Authorization: Bearer <key>`` or ``X-API-Key: <key>`` (401 otherwise).
- ``content_type_error``: a POST body must be ``Content-Type: application/json`` (415), so a page
  on another site cannot post to the server as a "simple" cross-origin request.
- ``read_body``: the body, read chunk by chunk: 413 once it passes ``max_bytes`` (at once for a
  Content-Length over it), 408 when it has not all arrived ``read_timeout_s`` after the headers.
- ``parse_request``: JSON with integers of at most ``MAX_DIGITS`` digits and no NaN/Infinity, then
  the fields and their bounds (400 or 413).
- ``HeaderTimeoutH11Protocol``: uvicorn's h11 protocol, closing a connection whose request headers
  take longer than ``header_timeout_s``.

Every refusal is a JSON ``{"error": "...", "limit"?: "...", "value"?: ...}`` naming what to change.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from omegaconf import DictConfig
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from nmt.inference.requests import Request as TranslationRequest

OPTIONS = {"text", "beam_size", "nbest", "attention", "alignments", "prefix", "constraints", "tgt_lang", "src_lang"}
MAX_CONSTRAINTS = 10  # phrases a sentence may require
MAX_DIGITS = 20  # an integer literal longer than this is refused before int() reads it
OPEN_PATHS = ("/health", "/")  # and /static/...: the page loads without a key, then asks for one


ESCAPED_BYTES = 12  # the most bytes one character takes in JSON: a character outside the BMP as two six-byte \\u escapes


def max_body_bytes(limits: DictConfig) -> int:
    """The largest body a request within the limits can have: per sentence its text, its prefix
    and its constraints (each up to ``max_chars`` characters, every one escaped at
    ``ESCAPED_BYTES``), with their quotes and separators, plus 1 KiB for the rest."""
    per_sentence = 3 * (int(limits.max_chars) * ESCAPED_BYTES) + 4 * (MAX_CONSTRAINTS + 2) + 8
    return int(limits.max_sentences) * per_sentence + 1024


def error(status: int, message: str, limit: str | None = None, value: Any = None, close: bool = False) -> JSONResponse:
    """The JSON error response; ``close``: end the connection after it."""
    body: dict[str, Any] = {"error": message}
    if limit is not None:
        body.update(limit=limit, value=value)
    return JSONResponse(body, status_code=status, headers={"Connection": "close"} if close else None)


class AmbiguousLengthMiddleware:
    """Closes the connection after answering a request that declares both Content-Length and
    Transfer-Encoding: the body is read as chunked, but a proxy in front may have framed it by
    Content-Length, so a request pipelined after it could be one the proxy never saw (RFC 9112,
    6.1: such a connection must close)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        names = {name.lower() for name, _ in scope.get("headers", ())} if scope["type"] == "http" else set()
        if not {b"content-length", b"transfer-encoding"} <= names:
            return await self.app(scope, receive, send)

        async def closing(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, closing)


class ApiKeyMiddleware:
    """401 for a request without the key, except ``OPEN_PATHS`` and ``/static/``; the key is
    compared in constant time (``hmac.compare_digest``)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith("/static/"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key")
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if given is None and scheme.lower() == b"bearer":
            given = token.strip()
        if given is not None and hmac.compare_digest(given, self.key):
            return await self.app(scope, receive, send)
        what = "a wrong API key" if given is not None else "no API key"
        response = error(401, f'the request has {what}; this server needs "Authorization: Bearer <key>" or '
                              '"X-API-Key: <key>" (the api_key the server was started with)')
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def content_type_error(request: Request) -> JSONResponse | None:
    """A 415 unless the body is declared as ``application/json`` (UTF-8, the only charset taken)."""
    value = request.headers.get("content-type", "")
    media, _, params = value.partition(";")
    charset = next((p.split("=", 1)[1].strip(' "').lower() for p in params.split(";")
                    if p.strip().lower().startswith("charset=")), "utf-8")
    if media.strip().lower() == "application/json" and charset in ("utf-8", "utf8"):
        return None
    shown = f"Content-Type {value[:80]!r}" if value else "no Content-Type"
    return error(415, f'the request has {shown}; send a UTF-8 JSON body with "Content-Type: application/json"')


async def read_body(request: Request, max_bytes: int, read_timeout_s: float) -> bytes | JSONResponse:
    """The body, or a 413 as soon as it passes ``max_bytes`` (chunked bodies included; a
    Content-Length over it before reading anything), or a 408 when it has not all arrived
    ``read_timeout_s`` after the headers (and the connection closes). After a 413 (or a 401 or 415)
    the server reads and drops what the client still sends, for at most ``header_timeout_s``, so
    that a client sending its whole body before reading gets the answer, not a reset connection."""
    def too_big(size: str) -> JSONResponse:
        return error(413, f"the request has {size} bytes; the limit is {max_bytes} (limits.max_sentences x "
                          "limits.max_chars); send fewer or shorter sentences", "max_request_bytes", max_bytes)

    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        return too_big(declared)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + read_timeout_s
    chunks: list[bytes] = []
    size = 0
    stream = request.stream()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), max(0.0, deadline - loop.time()))
            except StopAsyncIteration:
                return b"".join(chunks)
            size += len(chunk)
            if size > max_bytes:
                return too_big(f"more than {max_bytes}")
            chunks.append(chunk)
    except TimeoutError:
        return error(408, f"the request body did not arrive within {read_timeout_s} s of its headers "
                          "(limits.read_timeout_s); send it at once", "read_timeout_s", read_timeout_s, close=True)
    except ClientDisconnect:
        return error(400, "the client closed the connection before the end of the body", close=True)


class Refused(ValueError):
    """A JSON value ``parse_request`` does not read (a NaN, an integer of too many digits)."""


def _bounded_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_DIGITS:
        raise Refused(f"an integer of {len(literal.lstrip('-'))} digits; numbers in a request have at most {MAX_DIGITS}")
    return int(literal)


def _no_constant(name: str) -> float:
    raise Refused(f"{name} is not a JSON number; send an integer")


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_request(body: bytes, limits: DictConfig, default_beam: int, can_align: bool = True,
                  default_align: bool = False, default_lang: str | None = None,
                  default_src_lang: str | None = None) -> tuple[TranslationRequest, tuple[Any, ...]] | JSONResponse:
    """The ``nmt.inference.requests.Request`` (sentences, ``"tgt_lang"`` else ``default_lang``, ``"src_lang"``
    else ``default_src_lang`` (an imported M2M100/NLLB-200/mBART-50 model's), prefixes or constraints)
    and (beam_size, nbest, attention, alignments) of a request body, or the error response: its
    JSON, types and sizes are checked here; what the request means for the model, by the
    translator (``nmt.inference.requests``)."""
    try:
        request = json.loads(body.decode("utf-8"), parse_int=_bounded_int, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        return error(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})")
    except Refused as e:
        return error(400, f"{e}")
    except json.JSONDecodeError as e:
        return error(400, f"malformed JSON: {e.msg} (line {e.lineno}, column {e.colno})")
    except RecursionError:
        return error(400, "malformed JSON: nested too deeply")
    except ValueError as e:  # nothing json.loads raises may become a 500
        return error(400, f"malformed JSON: {e}")
    if not isinstance(request, dict):
        return error(400, 'the request must be a JSON object: {"text": ["a sentence", ...]}')
    if unknown := sorted(set(request) - OPTIONS):
        return error(400, f"unknown field(s) {_shown(unknown)}: the fields are {', '.join(sorted(OPTIONS))}")
    texts = request.get("text")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        return error(400, '"text" must be a string or a list of strings')
    if len(texts) > limits.max_sentences:
        return error(413, f"{len(texts)} sentences in one request; the limit is max_sentences={limits.max_sentences}",
                     "max_sentences", limits.max_sentences)
    for i, text in enumerate(texts):
        if len(text) > limits.max_chars:
            return error(413, f"sentence {i} has {len(text)} characters; the limit is max_chars={limits.max_chars}",
                         "max_chars", limits.max_chars)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return error(400, f"sentence {i} is not valid Unicode (a lone surrogate escape such as \\ud800)")
    values = {}
    for key, default, top in (("beam_size", default_beam, limits.max_beam_size), ("nbest", 1, None)):
        value = request.get(key, default)
        top = values.get("beam_size") if top is None else top
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            return error(400, f'"{key}" must be an integer from 1 to {top}' + (" (the beam size)" if key == "nbest" else "")
                         + f", not {_shown(value)}")
        values[key] = value
    attention = request.get("attention", False)
    if not isinstance(attention, bool) and attention != "heads":
        return error(400, f'"attention" must be true, false or "heads", not {_shown(attention)}')
    alignments = request.get("alignments", default_align)
    if not isinstance(alignments, bool):
        return error(400, f'"alignments" must be true or false, not {_shown(alignments)}')
    if alignments and not can_align:
        return error(400, '"alignments": this server\'s CTranslate2 folder was exported before nmt-export kept every '
                          "head's attention; export it again")
    lang = request.get("tgt_lang", default_lang)
    if lang is not None and not isinstance(lang, str):
        return error(400, f'"tgt_lang" must be a language code such as "fr", not {_shown(lang)}')
    src_lang = request.get("src_lang", default_src_lang)
    if src_lang is not None and not isinstance(src_lang, str):
        return error(400, f'"src_lang" must be a language code such as "deu_Latn", not {_shown(src_lang)}')
    guide = _guide(request, texts, limits)
    if isinstance(guide, JSONResponse):
        return guide
    return (TranslationRequest(texts, lang, src_lang=src_lang, **guide),
            (values["beam_size"], values["nbest"], attention, alignments))


def _guide(request: dict[str, Any], texts: list[str], limits: DictConfig) -> dict[str, Any] | JSONResponse:
    """``"prefix"`` (a string per sentence) and ``"constraints"`` (a list of phrases per sentence)
    as ``Request`` keys, their types and sizes checked; {} when the request has neither."""
    prefix, constraints = request.get("prefix"), request.get("constraints")
    guides: dict[str, Any] = {}
    if prefix is not None:
        if not isinstance(prefix, list) or len(prefix) != len(texts) or not all(isinstance(p, str) for p in prefix):
            return error(400, f'"prefix" must be a list of {len(texts)} strings, one per sentence ("" for none)')
        if any(len(p) > limits.max_chars for p in prefix):
            return error(413, f"a prefix over max_chars={limits.max_chars} characters", "max_chars", limits.max_chars)
        if (bad := _not_unicode(prefix)) is not None:
            return error(400, f"prefix {bad}: not valid Unicode (a lone surrogate escape such as \\ud800)")
        guides["prefixes"] = prefix
    if constraints is None:
        return guides
    if not isinstance(constraints, list) or len(constraints) != len(texts) or not all(
            isinstance(c, list) and all(isinstance(p, str) for p in c) for c in constraints):
        return error(400, f'"constraints" must be a list of {len(texts)} lists of phrases, one per sentence ([] for none)')
    for i, phrases in enumerate(constraints):
        if len(phrases) > MAX_CONSTRAINTS:
            return error(413, f"sentence {i} has {len(phrases)} constraints; the limit is {MAX_CONSTRAINTS}")
        if sum(len(p) for p in phrases) > limits.max_chars:
            return error(413, f"the constraints of sentence {i} have over max_chars={limits.max_chars} characters",
                         "max_chars", limits.max_chars)
        if (bad := _not_unicode(phrases)) is not None:
            return error(400, f"constraint {bad} of sentence {i}: not valid Unicode (a lone surrogate escape such as \\ud800)")
    guides["constraints"] = constraints
    return guides


def _not_unicode(texts: list[str]) -> int | None:
    """The index of the first text that is not valid Unicode (a lone surrogate), if any."""
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return i
    return None


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing the connection when a request's headers are not all in
    ``header_timeout_s`` after the connection opens or its last response ends (uvicorn's own
    keep-alive timeout stops at the first byte, so a client sending headers a byte a minute would
    hold the connection forever)."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wait_for_headers()

    def on_response_complete(self) -> None:
        self._wait_for_headers()  # before the next pipelined request, which handle_events starts
        super().on_response_complete()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived
            self._cancel()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def _wait_for_headers(self) -> None:
        self._cancel()
        self.header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_too_slow(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

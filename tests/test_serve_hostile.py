"""nmt-serve against hostile clients: bodies over the size limit (chunked included) refused while
they stream, stalled headers and bodies timed out, SIGTERM with a stalled client, number literals
that are not small integers, the wrong Content-Type, CORS, the API key, no external asset; and
property tests (Hypothesis) that no input, bytes or JSON, gets a 5xx. The raw-socket tests run a
real ``nmt-serve`` process on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="nmt-serve needs fastapi: pip install 'nmt[serve]'")
httpx = pytest.importorskip("httpx", reason="the API tests need httpx: pip install 'nmt[test]'")
pytest.importorskip("hypothesis", reason="the property tests need hypothesis: pip install 'nmt[test]'")
from fastapi.responses import JSONResponse  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nmt.inference.translator import Translator  # noqa: E402
from nmt.serve.app import STATIC, create_app, load, parse_request  # noqa: E402
from tests.conftest import ROOT, serve_cfg  # noqa: E402

SMALL = ("decoding=greedy", "limits.max_sentences=8", "limits.max_chars=200", "batching.process=false")
MAX_BODY = 8 * (3 * 200 * 12 + 4 * 12 + 8) + 1024  # create_app's limit for SMALL: 59,072 bytes
JSON = {"Content-Type": "application/json"}
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def translator(serve_ckpt: Path) -> Translator:
    return load(serve_cfg(serve_ckpt, *SMALL))


@pytest.fixture(scope="module")
def make_app(serve_ckpt: Path, translator: Translator) -> Callable[..., Any]:
    """``create_app`` for the SMALL config plus ``overrides`` (``++key=value``: new keys compose on older code too)."""
    return lambda *overrides: create_app(translator, serve_cfg(serve_ckpt, *SMALL, *overrides))


@pytest.fixture(scope="module")
def client(make_app):
    with TestClient(make_app(), raise_server_exceptions=False) as client:
        yield client


def post_asgi(app, headers: dict[str, str], chunks: Iterable[bytes], stall: bool = False) -> tuple[int, dict[str, str], dict, int]:
    """POST /translate straight to the ASGI app, the body in ``chunks`` (then the end, or a client
    that stalls); (status, headers, JSON body, chunks the app took). 30 s bound: a hang fails."""
    chunks, taken, sent = iter(chunks), 0, []

    async def receive() -> dict[str, Any]:
        nonlocal taken
        chunk = next(chunks, None)
        if chunk is None:
            if stall:
                await asyncio.Event().wait()  # until cancelled
            return {"type": "http.request", "body": b"", "more_body": False}
        taken += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/translate", "raw_path": b"/translate", "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(body), taken


# --- size and time --------------------------------------------------------------------------------
def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(make_app):
    """No Content-Length (chunked): the app stops at the first chunk past the limit, not at the end."""
    status, _, body, taken = post_asgi(make_app(), JSON, (b" " * 4096 for _ in range(400)))
    assert status == 413 and body["limit"] == "max_request_bytes" and body["value"] == MAX_BODY
    assert taken == MAX_BODY // 4096 + 1


def test_a_content_length_over_the_limit_is_refused_before_reading(make_app):
    status, _, body, taken = post_asgi(make_app(), {**JSON, "Content-Length": str(400 * 4096)},
                                       (b" " * 4096 for _ in range(400)))
    assert status == 413 and body["limit"] == "max_request_bytes" and taken == 0


def test_a_stalled_body_is_a_408(make_app):
    app = make_app("++limits.read_timeout_s=0.5")
    status, headers, body, taken = post_asgi(app, {**JSON, "Content-Length": "100"}, [b'{"text": ["a'], stall=True)
    assert status == 408 and body["limit"] == "read_timeout_s" and taken == 1
    assert headers["connection"] == "close"


def test_sentences_of_characters_outside_the_bmp_within_max_chars_are_not_a_413(client):
    """A character outside the BMP is 12 bytes of JSON (two \\uXXXX escapes): 8 sentences of 200
    of them, with a prefix each as long, fit the body limit."""
    texts = ["\U0001F600" * 200] * 8
    body = json.dumps({"text": texts, "prefix": [""] * 8})  # ensure_ascii: every character escaped
    assert len(body) > 8 * 200 * 12
    response = client.post("/translate", content=body.encode(), headers=JSON)
    assert response.status_code in (200, 400), response.text  # 400: characters the vocabulary lacks, named
    assert response.status_code == 200 or "max_request_bytes" not in response.text


def test_max_work_counts_nbest_attention_and_alignments(make_app, translator):
    """A request within source tokens x beam size is refused when its n-best lists, attention or
    alignments make it heavy: each weight the search keeps, aligns or sends counts 1/16 of a unit."""
    from nmt.serve.app import decoding_work, target_cap

    text = "ein mann schläft auf einer bank ."
    n = translator.count_tokens([text])
    t = target_cap(translator, n)
    assert t == int(1.5 * n) + 10
    assert decoding_work([n], 4) == n * 4 + t
    assert decoding_work([n], 4, nbest=3, attention=True, alignments=True) == n * 4 + 3 * t + -(-(4 * t * n + 3 * t * n) // 16)
    limit = n * 4 * 8 + 8 * t  # 8 sentences at beam 4 fit...
    with TestClient(make_app(f"limits.max_work={limit}"), raise_server_exceptions=False) as client:
        plain = client.post("/translate", json={"text": [text] * 8, "beam_size": 4})
        heavy = client.post("/translate", json={"text": [text] * 8, "beam_size": 4, "nbest": 4, "attention": True,
                                                "alignments": True})
    assert plain.status_code == 200, plain.text
    work = 8 * decoding_work([n], 4, nbest=4, attention=True, alignments=True)
    assert heavy.status_code == 413 and heavy.json()["error"].startswith(f"the request asks for {work:,} units of work")


def test_one_failing_request_fails_no_other_of_its_batch():
    """Six requests gathered into one batch, one of which the decoder cannot take: the batch is
    decoded again request by request, five get their translations, the bad one its own error."""
    from nmt.serve.batching import Batcher

    def decode(texts, options):
        if "bad" in texts:
            raise IndexError("index out of range in self")
        return [t.upper() for t in texts]

    async def scenario():
        batcher = Batcher(decode, max_wait_ms=200, max_gather_ms=1000)
        jobs = [asyncio.ensure_future(batcher.submit([text], "same", 1)) for text in ("a", "b", "bad", "c", "d", "e")]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        stats = dict(batcher.stats)
        await batcher.stop()
        return results, stats

    results, stats = asyncio.run(scenario())
    assert results[:2] == [["A"], ["B"]] and results[3:] == [["C"], ["D"], ["E"]]
    assert isinstance(results[2], IndexError) and stats["requests"] == 5


# --- what is parsed -------------------------------------------------------------------------------
def test_a_huge_integer_literal_is_a_400(client):
    """Python's int() refuses over 4,300 digits with a ValueError inside json.loads: it was a 500."""
    digits = "9" * 5000
    for body in (f'{{"text": ["a"], "beam_size": {digits}}}', f'{{"text": ["a"], "nbest": -{digits}}}',
                 f'{{"text": [{digits}]}}', f'{{"other": {digits}}}'):
        response = client.post("/translate", content=body.encode(), headers=JSON)
        assert response.status_code == 400, response.text
        assert "5000 digits" in response.json()["error"]


def test_nan_infinity_and_float_literals_are_a_400_naming_them(client):
    for literal, named in (("NaN", "NaN is not a JSON number"), ("Infinity", "Infinity is not"),
                           ("-Infinity", "-Infinity is not"), ("5.0", "not 5.0"), ("1e999", "not Infinity")):
        for field in ("beam_size", "nbest"):
            response = client.post("/translate", content=f'{{"text": ["a"], "{field}": {literal}}}'.encode(), headers=JSON)
            assert response.status_code == 400 and named in response.json()["error"], (literal, response.text)


def test_a_body_that_is_not_declared_json_is_a_415(client):
    """A page on another site can POST text/plain, form or multipart bodies without a CORS preflight."""
    body = json.dumps({"text": ["a"]}).encode()
    for content_type in ("text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/jsonx", "application/json; charset=latin-1", None):
        headers = {"Content-Type": content_type} if content_type else {}
        response = client.post("/translate", content=body, headers=headers)
        assert response.status_code == 415, (content_type, response.text)
        assert "Content-Type: application/json" in response.json()["error"]
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
        assert client.post("/translate", content=body, headers={"Content-Type": content_type}).status_code == 200


# --- who may ask ----------------------------------------------------------------------------------
def test_cors_is_off_by_default_and_allows_exactly_the_configured_origins(client, make_app):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    evil, good = {"Origin": "http://evil.example"}, {"Origin": "http://allowed.example"}
    assert "access-control-allow-origin" not in client.get("/health", headers=evil).headers
    assert "access-control-allow-origin" not in client.post("/translate", json={"text": ["a"]}, headers=evil).headers
    assert "access-control-allow-origin" not in client.options("/translate", headers={**evil, **preflight}).headers
    with TestClient(make_app("++cors_origins=['http://allowed.example']")) as configured:
        assert configured.get("/health", headers=good).headers["access-control-allow-origin"] == "http://allowed.example"
        answer = configured.options("/translate", headers={**good, **preflight})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://allowed.example"
        assert "access-control-allow-origin" not in configured.get("/health", headers=evil).headers
        assert "access-control-allow-origin" not in configured.options("/translate", headers={**evil, **preflight}).headers


def check_key(client: TestClient) -> None:
    request = {"text": ["a"]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        response = client.post("/translate", json=request, headers=headers)
        assert response.status_code == 401 and "X-API-Key" in response.json()["error"], (headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
    for path in ("/info", "/report.png"):
        assert client.get(path).status_code == 401, path
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {KEY}"}, {"X-API-Key": KEY}):
        assert client.post("/translate", json=request, headers=headers).status_code == 200, headers
        assert client.get("/info", headers=headers).status_code == 200
    for path in ("/health", "/", "/static/app.js", "/static/style.css"):  # the page loads, then asks for the key
        assert client.get(path).status_code == 200, path


def test_an_api_key_is_required_when_configured(make_app):
    with TestClient(make_app(f"++api_key={KEY}")) as client:
        check_key(client)


def test_the_api_key_comes_from_nmt_serve_api_key(make_app, monkeypatch):
    monkeypatch.setenv("NMT_SERVE_API_KEY", KEY)
    with TestClient(make_app()) as client:
        check_key(client)


def test_an_empty_api_key_is_refused_at_start(make_app):
    with pytest.raises(ValueError, match="api_key"):
        make_app("++api_key=''")


URL = re.compile(r"https?://[^\s\"'<>)]+")


def test_no_api_docs_and_nothing_served_references_an_external_url(client):
    """FastAPI's /docs loads Swagger UI from a CDN: off unless docs=true."""
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path).status_code == 404, path
    for path in ("/", "/info", "/health", *(f"/static/{f.name}" for f in STATIC.iterdir())):
        response = client.get(path)
        assert response.status_code == 200 and URL.findall(response.text) == [], path
    for file in STATIC.iterdir():
        assert URL.findall(file.read_text()) == [], file


# --- a real server on 127.0.0.1 -------------------------------------------------------------------
def start_server(ckpt: Path, folder: Path, *overrides: str) -> tuple[subprocess.Popen, int]:
    """``nmt-serve`` on 127.0.0.1 (a free port), answering /health; its log in ``folder/server.log``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (folder / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "nmt.serve.app", f"ckpt={ckpt}", "host=127.0.0.1", f"port={port}",
                               *SMALL, *overrides], cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server, port
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"nmt-serve did not start: {(folder / 'server.log').read_text()[-3000:]}")
        time.sleep(0.2)


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.kill()
        server.wait(10)


@pytest.fixture(scope="module")
def server(serve_ckpt, tmp_path_factory):
    server, port = start_server(serve_ckpt, tmp_path_factory.mktemp("server"), "++limits.header_timeout_s=1",
                                "++limits.read_timeout_s=1")
    yield port
    stop(server)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)  # a server that never answers fails the test


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or resets it: it closed with
    bytes of ours unread)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


@pytest.mark.slow  # a real server process: the slow tier
def test_real_server_closes_a_connection_whose_headers_stall(server):
    with connect(server) as s:
        s.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and no more
        assert read_all(s) == b""


@pytest.mark.slow  # a real server process: the slow tier
def test_real_server_answers_408_to_a_stalled_body(server):
    with connect(server) as s:
        s.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b'Content-Length: 100\r\n\r\n{"text": ["a')
        assert read_all(s).startswith(b"HTTP/1.1 408 ")


@pytest.mark.slow  # a real server process: the slow tier
def test_real_server_refuses_an_endless_chunked_body_with_413(server):
    """A chunked body that never ends: a 413 while it streams (the old server read it whole first);
    the server then drops what still comes for header_timeout_s and closes."""
    head = b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    with connect(server) as s:  # first a chunked body under the limit: translated
        s.sendall(head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b'{"text": ', b'["a"]}', b"")))
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
    chunk = b"1000\r\n" + b" " * 4096 + b"\r\n"
    with connect(server) as s:
        s.sendall(head)
        for _ in range(16384):  # at most 64 MiB, stopping when the server answers or closes
            if select.select([s], [], [], 0)[0]:
                break
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]


@pytest.mark.slow  # a real server process: the slow tier
def test_real_server_closes_a_connection_whose_request_has_both_body_lengths(server):
    """Content-Length and Transfer-Encoding together (request smuggling's tool): the body is read
    as chunked, and the connection closes after the answer, so a pipelined second request is not
    read with a framing the two ends may disagree on (RFC 9112, 6.1)."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b'{"text": ["a"]}', b""))
    first = (b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    second = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with connect(server) as s:
        s.sendall(first + second)
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 ") == 1, answer[:500]
    with connect(server) as s:  # a request with one length keeps its connection
        s.sendall(first.replace(b"Content-Length: 4\r\n", b"") + second)
        s.settimeout(5)
        seen = b""
        while seen.count(b"HTTP/1.1 200 ") < 2:
            seen += s.recv(65536)


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_sigterm_exits_while_a_client_stalls_mid_body(serve_ckpt, tmp_path):
    """shutdown_timeout_s bounds the wait for in-flight requests: a client that sent half a body
    and stalled no longer keeps the server from exiting."""
    server, port = start_server(serve_ckpt, tmp_path, "++shutdown_timeout_s=2", "++limits.read_timeout_s=600")
    try:
        with connect(port) as stalled:
            stalled.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            b'Content-Length: 1000\r\n\r\n{"text": ["a')
            # answered after the server has taken the stalled request's headers (one event loop)
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                pytest.fail("nmt-serve still runs 30 s after SIGTERM with a stalled client")
    finally:
        stop(server)


# --- properties: no input gets a 5xx --------------------------------------------------------------
TRIED: Counter[str] = Counter()  # inputs each property test ran


def check(name: str, strategy: st.SearchStrategy, prop: Callable[[Any], None], examples: int) -> None:
    """``prop`` on ``examples`` inputs from ``strategy`` (the same ones every run), counted in TRIED."""
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(strategy)
    def run(value: Any) -> None:
        TRIED[name] += 1
        prop(value)

    run()
    print(f"{name}: {TRIED[name]} inputs, {sum(TRIED.values())} in all")


FIELDS = st.sampled_from(["text", "beam_size", "nbest", "attention", "alignments", "prefix", "constraints"]) | st.text(max_size=8)
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats() | st.text(max_size=30),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(FIELDS, inner, max_size=4), max_leaves=12)
LITERALS = (st.integers(-10**6, 10**6).map(str) | st.integers(15, 6000).map(lambda n: "9" * n)
            | st.sampled_from(["NaN", "Infinity", "-Infinity", "5.0", "1e999", "-0", "2", "true", '"3"', "[", "\"\\ud800\""]))
BODIES = (st.binary(max_size=400)
          | VALUES.map(lambda v: json.dumps(v).encode())
          | st.dictionaries(FIELDS, VALUES, max_size=5).map(lambda v: json.dumps(v).encode())
          | st.tuples(VALUES, LITERALS, LITERALS).map(
              lambda t: f'{{"text": {json.dumps(t[0])}, "beam_size": {t[1]}, "nbest": {t[2]}}}'.encode())
          | st.integers(1, 6000).map(lambda depth: b'{"text": ' + b"[" * depth + b"]" * depth + b"}"))
CONTENT_TYPES = st.sampled_from([None, "application/json", "application/json; charset=utf-8", "text/plain",
                                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", b"\xe9/json"])


def test_parse_request_answers_every_body_with_a_request_or_a_4xx(serve_ckpt, translator):
    limits = serve_cfg(serve_ckpt, *SMALL).limits

    def prop(body: bytes) -> None:
        result = parse_request(body, limits, translator.settings.beam_size)
        if isinstance(result, JSONResponse):
            assert result.status_code in (400, 413) and json.loads(result.body)["error"]
        else:
            request, (beam_size, nbest, attention, alignments) = result
            texts = request.texts
            assert all(isinstance(t, str) and len(t) <= limits.max_chars for t in texts) and len(texts) <= limits.max_sentences
            assert 1 <= nbest <= beam_size <= limits.max_beam_size and isinstance(attention, bool)
            assert isinstance(alignments, bool) and request.tgt_lang is None or isinstance(request.tgt_lang, str)
            for guide in (request.prefixes, request.constraints):
                assert guide is None or len(guide) == len(texts)

    check("parse_request", BODIES, prop, 600)


def test_the_app_answers_every_body_and_content_type_without_a_5xx(client):
    def prop(case: tuple[bytes, str | bytes | None]) -> None:
        body, content_type = case
        headers = {"Content-Type": content_type} if content_type else {}
        response = client.post("/translate", content=body, headers=headers)
        assert response.status_code in (200, 400, 413, 415), (response.status_code, response.text)
        assert response.status_code == 200 or response.json()["error"]

    check("app: bytes x Content-Type", st.tuples(BODIES, CONTENT_TYPES), prop, 300)


def test_the_app_translates_any_unicode_text(client):
    """Valid requests of arbitrary text (the decoding-heavy case: few examples)."""
    requests = st.fixed_dictionaries({"text": st.lists(st.text(max_size=40), max_size=3)},
                                     optional={"beam_size": st.integers(1, 3), "attention": st.booleans(), "alignments": st.booleans()})

    def prop(request: dict[str, Any]) -> None:
        response = client.post("/translate", json=request)
        assert response.status_code == 200, response.text
        assert len(response.json()["translations"]) == len(request["text"])

    check("app: valid requests", requests, prop, 25)


def test_the_report_is_the_run_folders_or_the_release_files_never_a_path_the_config_names(serve_ckpt, tmp_path):
    """A checkpoint's module.report_dir once made the server read and serve files from any folder."""
    import torch

    from nmt.checkpoints.files import read_checkpoint
    from nmt.export import export_release

    run = serve_ckpt.parent.parent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "bleu_by_length.json").write_text('{"bleu": 12.5}')
    (elsewhere / "bleu_by_length.png").write_bytes(b"\x89PNG\r\n\x1a\n not the run's")
    checkpoint = read_checkpoint(serve_ckpt)
    checkpoint["run_config"]["module"]["report_dir"] = str(elsewhere)
    moved = tmp_path / "moved.ckpt"
    torch.save(checkpoint, moved)
    released = export_release(serve_ckpt, tmp_path / "release.ckpt")
    expected = {moved: (False, 404, None), released: (True, 200, (run / "bleu_by_length.png").read_bytes()),
                serve_ckpt: (True, 200, (run / "bleu_by_length.png").read_bytes())}
    for ckpt, (has_report, status, png) in expected.items():
        cfg = serve_cfg(ckpt, *SMALL)
        with TestClient(create_app(load(cfg), cfg), raise_server_exceptions=False) as client:
            info = client.get("/info").json()
            assert info["report"] is has_report and (info["training"].get("test_bleu") != 12.5)
            answer = client.get("/report.png")
            assert answer.status_code == status, ckpt
            if png is not None:
                assert answer.content == png and answer.headers["content-type"] == "image/png"


def test_info_passes_on_only_finite_numbers_and_short_strings_from_a_release_file(serve_ckpt, tmp_path):
    """NaN in a report or run config, bytes as a run name: once a 500 (JSON has no NaN)."""
    import math

    import torch

    from nmt.checkpoints.files import read_checkpoint
    from nmt.export import export_release

    forged = read_checkpoint(export_release(serve_ckpt, tmp_path / "release.ckpt"))
    forged["report"]["summary"]["bleu"] = math.nan
    forged["report"]["summary"]["buckets"][0]["bleu"] = math.inf
    forged["run_config"].update(tags=[math.nan, "x" * 10_000], task_name=b"\xff")
    forged["run_config"]["data"]["src_lang"] = math.nan
    torch.save(forged, tmp_path / "forged.ckpt")
    cfg = serve_cfg(tmp_path / "forged.ckpt", *SMALL)
    with TestClient(create_app(load(cfg), cfg), raise_server_exceptions=False) as client:
        answer = client.get("/info")
    assert answer.status_code == 200, answer.text
    info = answer.json()
    assert info["training"]["test_bleu"] is None and info["training"]["bleu_by_length"][0]["bleu"] is None
    assert info["training"]["tags"] == [None, "x" * 200] and info["training"]["run"] is None
    assert info["src_lang"] is None and info["preset"]["encoder"] == "TransformerEncoder"

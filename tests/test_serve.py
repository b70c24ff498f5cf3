"""nmt-serve on a trained tiny model: the API through FastAPI's test client (every endpoint, every
bad input, order under concurrent requests, batching equal to translate.py), and the page in a
real headless Chromium against a real ``nmt-serve`` process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

fastapi = pytest.importorskip("fastapi", reason="nmt-serve needs fastapi: pip install 'nmt[serve]'")
httpx = pytest.importorskip("httpx", reason="the API tests need httpx: pip install 'nmt[test]'")
from fastapi.testclient import TestClient  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402

from nmt.checkpoints.loading import load_checkpoint  # noqa: E402
from nmt.serve.app import create_app, load  # noqa: E402
from nmt.inference.translator import translate_lines  # noqa: E402
from nmt.decoding.search import search_of  # noqa: E402
from nmt.decoding.settings import SearchSettings  # noqa: E402
from tests.conftest import CONF_DIR, ROOT, serve_cfg  # noqa: E402

LINES = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()[:24]


@pytest.fixture(scope="module")
def ckpt(serve_ckpt: Path) -> Path:
    """The tiny Transformer of tests/conftest.py (trained once for every nmt-serve test file)."""
    return serve_ckpt


@pytest.fixture(scope="module")
def client(ckpt):
    cfg = serve_cfg(ckpt, "decoding=greedy", "limits.max_sentences=8", "limits.max_chars=200",
                    "batching.max_wait_ms=20")
    with TestClient(create_app(load(cfg), cfg)) as client:
        yield client


def reference(ckpt: Path, lines: list[str], decoding: str = "greedy", **options) -> list[str]:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        search = search_of(SearchSettings.from_config(compose("translate", overrides=[
            f"ckpt={ckpt}", f"decoding={decoding}", *[f"decoding.{k}={v}" for k, v in options.items()]]).decoding))
    loaded = load_checkpoint(ckpt)
    return translate_lines(loaded.model, loaded.src_vocab, loaded.tgt_vocab, lines, search)[0]


def test_translate_health_info_and_page(client, ckpt):
    response = client.post("/translate", json={"text": LINES[:3] + [""]})
    assert response.status_code == 200
    rows = response.json()["translations"]
    assert [r["text"] for r in rows] == reference(ckpt, LINES[:3] + [""])
    assert rows[3] == {"text": "", "score": 0.0}
    assert client.post("/translate", json={"text": LINES[0]}).json()["translations"][0]["text"] == rows[0]["text"]
    assert client.post("/translate", json={"text": []}).json() == {"translations": []}
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["sentences"] >= 4
    info = client.get("/info").json()
    assert info["preset"] == {"encoder": "TransformerEncoder", "decoder": "TransformerDecoder"}
    assert info["parameters"] > 0 and info["src_vocab_size"] > 0 and info["tgt_vocab_size"] > 0
    assert info["src_lang"] and info["tgt_lang"] and info["attention"] is True
    assert info["report"] is True and isinstance(info["training"]["test_bleu"], float)
    assert info["limits"]["max_sentences"] == 8
    page = client.get("/")
    assert page.status_code == 200 and 'id="source"' in page.text
    for asset in ("/static/app.js", "/static/style.css", "/report.png"):
        assert client.get(asset).status_code == 200, asset


def test_beam_nbest_and_attention(client, ckpt):
    rows = client.post("/translate", json={"text": LINES[:4], "beam_size": 3, "nbest": 3, "attention": True}).json()
    rows = rows["translations"]
    assert [r["text"] for r in rows] == reference(ckpt, LINES[:4], "beam", beam_size=3)
    for row in rows:
        assert 1 <= len(row["nbest"]) <= 3 and row["nbest"][0]["text"] == row["text"]
        scores = [h["score"] for h in row["nbest"]]
        assert scores == sorted(scores, reverse=True)
        att = row["attention"]
        assert len(att["weights"]) == len(att["target"]) and all(len(w) == len(att["source"]) for w in att["weights"])
        assert all(abs(sum(w) - 1) < 1e-2 for w in att["weights"])
        assert att["source"][-1] == att["target"][-1] == "</s>"


def test_attention_heads_are_each_layer_and_head_whose_last_layer_mean_is_the_search_attention(client, ckpt):
    """``"attention": "heads"``: every cross-attention head, teacher-forced on the translation; the
    last layer's mean over its heads is the attention the beam search kept (to the replies' rounding),
    and the per-head table has a row per head of each kind with shares in [0, 1]."""
    rows = client.post("/translate", json={"text": LINES[:3], "beam_size": 3, "attention": "heads"}).json()["translations"]
    plain = client.post("/translate", json={"text": LINES[:3], "beam_size": 3, "attention": True}).json()["translations"]
    info = client.get("/info").json()
    for row, same in zip(rows, plain):
        assert row["text"] == same["text"] and row["attention"]["weights"] == same["attention"]["weights"]
        heads, att = row["attention"]["heads"], row["attention"]
        assert sum(len(layer) for layer in heads) == info["heads"] > 1
        assert all(len(h) == len(att["target"]) and all(len(r) == len(att["source"]) for r in h) for layer in heads for h in layer)
        mean = torch.tensor(heads[-1]).mean(0)
        torch.testing.assert_close(mean, torch.tensor(att["weights"]), atol=2e-3, rtol=0)
        table = row["heads"]
        assert {r["kind"] for r in table} == {"encoder", "decoder", "cross"}
        assert len([r for r in table if r["kind"] == "cross"]) == info["heads"]
        assert all(0 <= r["confidence"] <= 1 and 0 <= r["rare"] <= 1 for r in table)
    assert "heads" not in plain[0] and "heads" not in plain[0]["attention"]


def test_attention_heads_of_a_model_without_them_is_a_400(client, monkeypatch):
    """An RNN, an ensemble or a CTranslate2 folder has no heads to show (``cross_heads`` 0): the
    request is refused in one line, and plain attention is still answered."""
    from types import SimpleNamespace

    from nmt.serve import app as serve_app
    from tests.test_models import build

    assert serve_app.cross_heads(SimpleNamespace(backend="torch", model=build("lstm_bahdanau"))) == 0
    assert serve_app.cross_heads(SimpleNamespace(backend="ctranslate2")) == 0
    monkeypatch.setattr(serve_app, "cross_heads", lambda translator: 0)
    response = client.post("/translate", json={"text": ["a"], "attention": "heads"})
    assert response.status_code == 400
    assert response.json()["error"] == ('"attention": "heads": this model has no attention heads to show (heads are '
                                        "a Transformer decoder's, read from a checkpoint or release file); ask for "
                                        '"attention": true')
    assert client.post("/translate", json={"text": ["a"], "attention": True}).status_code == 200


BAD = [
    (b'{"text": ["a"', 400, "malformed JSON"),
    (b"", 400, "malformed JSON"),
    (b'{"text": ["\xff\xfe"]}', 400, "not valid UTF-8"),
    (b'{"text": ["\\ud800"]}', 400, "lone surrogate"),
    (b'["a"]', 400, "JSON object"),
    (b"[" * 5000 + b"]" * 5000, 400, "nested too deeply"),
    (b'{"txt": ["a"]}', 400, "unknown field"),
    (b'{"text": 3}', 400, '"text" must be'),
    (b'{"text": ["a", 3]}', 400, '"text" must be'),
    (b'{"text": null}', 400, '"text" must be'),
    (b'{"text": ["a"], "beam_size": "5"}', 400, '"beam_size" must be'),
    (b'{"text": ["a"], "beam_size": 0}', 400, '"beam_size" must be'),
    (b'{"text": ["a"], "beam_size": true}', 400, '"beam_size" must be'),
    (b'{"text": ["a"], "beam_size": 2.5}', 400, '"beam_size" must be'),
    (b'{"text": ["a"], "beam_size": 99}', 400, '"beam_size" must be'),
    (b'{"text": ["a"], "beam_size": 2, "nbest": 3}', 400, '"nbest" must be'),
    (b'{"text": ["a"], "attention": "yes"}', 400, '"attention" must be true, false or "heads"'),
    (json.dumps({"text": ["a"] * 9}).encode(), 413, "max_sentences"),
    (json.dumps({"text": ["a" * 201]}).encode(), 413, "max_chars"),
    (b'{"text": ["' + b"a" * 100_000 + b'"]}', 413, "max_request_bytes"),
]


@pytest.mark.parametrize("body,status,message", BAD, ids=[m + f" {i}" for i, (_, _, m) in enumerate(BAD)])
def test_bad_input_is_a_4xx_naming_the_problem(client, body, status, message):
    response = client.post("/translate", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert message in response.json()["error"] + response.json().get("limit", "")
    if status == 413:
        assert response.json()["limit"] in message


def test_a_full_queue_is_a_429(ckpt):
    cfg = serve_cfg(ckpt, "decoding=greedy", "limits.max_queue=0", "batching.process=false")
    with TestClient(create_app(load(cfg), cfg)) as client:
        response = client.post("/translate", json={"text": ["a"]})
    assert response.status_code == 429 and response.json()["limit"] == "max_queue"


def test_concurrent_requests_are_batched_and_keep_their_order(ckpt):
    """40 requests at once, 1-4 sentences each (some empty), decoded in fewer batches than requests;
    each gets its own sentences back, in order, as translate.py translates them. The first decode
    waits until the other 39 requests are queued, so how they are batched does not depend on how
    fast the machine delivers them."""
    expected = dict(zip(LINES, reference(ckpt, LINES)))
    expected[""] = ""
    requests = [[LINES[(i * 7 + j) % len(LINES)] if (i + j) % 5 else "" for j in range(1 + i % 4)] for i in range(40)]
    cfg = serve_cfg(ckpt, "decoding=greedy", "limits.max_sentences=8", "limits.max_chars=200", "batching.process=false")
    translator, gate, submitted = load(cfg), threading.Event(), []
    decode = translator.translate
    translator.translate = lambda *args, **kwargs: gate.wait(600) and decode(*args, **kwargs)
    app = create_app(translator, cfg)
    submit = app.state.batcher.submit

    async def counted(*args, **kwargs):
        submitted.append(1)  # and submit queues the request before it first awaits
        return await submit(*args, **kwargs)

    app.state.batcher.submit = counted
    with TestClient(app) as client, ThreadPoolExecutor(len(requests)) as pool:
        # the test client's calls meet in its one event loop
        answers = [pool.submit(client.post, "/translate", json={"text": r}) for r in requests]
        for _ in range(6000):  # until every request is queued or held at the gate (a hang guard: 10 min)
            if len(submitted) == len(requests):
                break
            time.sleep(0.1)
        gate.set()
        responses = [a.result() for a in answers]
        batches = client.get("/health").json()["batches"]
    for request, response in zip(requests, responses):
        assert response.status_code == 200
        assert [row["text"] for row in response.json()["translations"]] == [expected[s] for s in request]
    assert batches <= 3  # the first request (with any that arrived within max_wait_ms), then the 39 queued ones


# --- the page in a real browser ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("no chromium/chromedriver on PATH (Debian: apt-get install -y chromium chromium-driver)")
    pytest.importorskip("selenium", reason="the browser test needs selenium: pip install 'nmt[test]'")
    return chromium, driver


@pytest.mark.slow  # end to end in processes of its own (a server, a headless browser): the slow tier
def test_the_page_translates_and_draws_the_heatmap_in_chromium(ckpt, tmp_path):
    chromium, driver = browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "nmt.serve.app", f"ckpt={ckpt}", f"port={port}", "decoding=greedy"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1100,900"):
        options.add_argument(arg)
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager never downloads a browser or driver
    page = None
    try:
        deadline = time.monotonic() + 600  # a hang guard: a busy machine only starts it later
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()[-3000:] if server.poll() is not None else "no /health in 600 s"
            time.sleep(0.2)
        page = webdriver.Chrome(options=options, service=Service(driver))
        page.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(page, 20)
        wait.until(lambda p: "parameters" in p.find_element(By.ID, "model").text)
        page.find_element(By.ID, "source").send_keys(LINES[0])
        page.find_element(By.ID, "translate").click()
        wait.until(lambda p: p.find_element(By.ID, "output").get_attribute("data-done"))
        shown = page.find_element(By.CSS_SELECTOR, "#output .best").text
        assert shown.startswith(reference(ckpt, LINES[:1])[0])
        heatmap = page.find_element(By.CSS_SELECTOR, "#heatmaps canvas")
        assert heatmap.size["width"] > 50 and heatmap.size["height"] > 50
        average = page.execute_script("return document.querySelector('#heatmaps canvas').toDataURL()")
        choices = page.execute_script("return [...document.getElementById('head').options].map(o => o.value)")
        assert choices[0] == "" and "0,0" in choices and len(choices) == 1 + client_heads(ckpt)
        page.execute_script("const s = document.getElementById('head'); s.value = '0,0'; s.dispatchEvent(new Event('change'))")
        assert page.execute_script("return document.querySelector('#heatmaps canvas').toDataURL()") != average
        table = page.find_elements(By.CSS_SELECTOR, "#heads tr")
        assert not page.find_element(By.ID, "head-table").get_attribute("hidden") and len(table) > 1 + client_heads(ckpt)
        assert page.execute_script("return document.getElementById('report-img').naturalWidth") > 0
        page.save_screenshot(str(tmp_path / "serve.png"))
        assert (tmp_path / "serve.png").stat().st_size > 1000
    finally:
        if page is not None:
            page.quit()
        server.terminate()
        server.wait(timeout=10)


def client_heads(ckpt) -> int:
    """The cross-attention heads of the checkpoint's model, all layers."""
    from nmt.models.head_mask import head_counts

    return sum(head_counts(load_checkpoint(ckpt).model)["cross"])


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_the_load_test_script_checks_every_response_against_translate_py(ckpt, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(ROOT / "scripts/load_test.py"), "--ckpt", str(ckpt), "--input", str(src),
                             "--clients", "4", "--sentences", "30", "--per-request", "3", "--timeout", "60",
                             "--json", str(tmp_path / "load.json"), "batching.process=false"], capture_output=True, text=True, timeout=180,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    numbers = json.loads((tmp_path / "load.json").read_text())
    assert numbers["sentences"] == 30 and numbers["errors"] == 0 and numbers["different"] == 0
    assert numbers["serve_sentences_per_s"] > 0 and numbers["ratio"] > 0


def test_a_request_over_its_decoding_work_budget_is_a_413_and_one_within_it_is_answered(ckpt):
    """Work: source tokens x beam size x (1 + constraints), plus nbest x the target cap (1.5 x
    source tokens + 10), summed over the sentences."""
    cfg = serve_cfg(ckpt, "decoding=greedy", "batching.process=false", "limits.max_work=120")
    translator = load(cfg)
    one = translator.count_tokens([LINES[0]])
    cap = int(1.5 * one) + 10
    with TestClient(create_app(translator, cfg)) as client:
        over = client.post("/translate", json={"text": [LINES[0]] * 2, "beam_size": 4,
                                               "constraints": [[LINES[0].split()[0]], []]})
        beam = (120 - cap) // one
        fits = client.post("/translate", json={"text": [LINES[0]], "beam_size": beam})
    work = one * 4 * 2 + one * 4 + 2 * cap
    assert over.status_code == 413 and over.json() == {
        "error": f"the request asks for {work:,} units of work (source tokens x beam size x (1 + constraints), n-best "
                 "tokens, attention and alignment weights / 16, summed over its sentences); the limit is "
                 "max_work=120: send fewer or shorter sentences, a smaller beam or n-best list, fewer constraints, "
                 "or leave out attention and alignments", "limit": "max_work", "value": 120}
    assert work > 120 >= one * beam + cap and beam >= 1 and fits.status_code == 200, fits.text


def test_a_request_whose_client_left_is_not_decoded_and_one_that_waited_too_long_gets_a_503():
    """The batcher alone, its decoder held at a gate: a request queued behind the decoding batch
    whose client disconnects is dropped before its batch; one that waited past max_queue_s is
    answered QueueTimeout (the server's 503) instead of being decoded."""
    import asyncio

    from nmt.serve.batching import Batcher, ClientGone, QueueTimeout

    gate, decoded = threading.Event(), []

    def decode(texts, options):
        gate.wait(60)
        decoded.append(list(texts))
        return [t.upper() for t in texts]

    async def scenario(max_queue_s, client_leaves):
        batcher = Batcher(decode, max_wait_ms=0, max_gather_ms=0, max_queue_s=max_queue_s)
        first = asyncio.ensure_future(batcher.submit(["a"], "x", 1))
        await asyncio.sleep(0.2)  # the first batch is decoding, held at the gate

        async def gone():
            return client_leaves

        second = asyncio.ensure_future(batcher.submit(["b"], "y", 1, gone=gone, poll_s=0.01))
        await asyncio.sleep(0.3)
        gate.set()
        results = await asyncio.gather(first, second, return_exceptions=True)
        await asyncio.sleep(0.1)
        stats = dict(batcher.stats)
        await batcher.stop()
        return results, stats

    results, stats = asyncio.run(scenario(None, client_leaves=True))
    assert results[0] == ["A"] and isinstance(results[1], ClientGone)
    assert decoded == [["a"]] and stats["abandoned"] == 1

    gate.clear()
    decoded.clear()
    results, stats = asyncio.run(scenario(0.1, client_leaves=False))
    assert results[0] == ["A"] and isinstance(results[1], QueueTimeout) and results[1].waited > 0.1
    assert decoded == [["a"]] and stats["timed_out"] == 1


def _dies_once(texts: list[str], marker: str) -> list[str]:
    """A decoding process's work that kills its process the first time (the marker file not yet
    written), as the kernel's OOM killer or a ``kill -9`` would."""
    if not os.path.exists(marker):
        Path(marker).write_text("killed once")
        os._exit(137)
    return [t.upper() for t in texts]


@pytest.mark.slow  # a decoding process killed and replaced, end to end: the slow tier
def test_a_killed_decoding_process_is_replaced_and_the_batch_decoded_again(tmp_path):
    """With ``batching.process``: the process decoding a batch dies; a new one decodes that batch
    (its requests are answered) and the ones after it."""
    import asyncio
    import functools
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from nmt.serve.batching import Batcher

    marker = str(tmp_path / "killed")
    restart = functools.partial(ProcessPoolExecutor, 1, mp_context=multiprocessing.get_context("spawn"))
    batcher = Batcher(_dies_once, max_wait_ms=1, executor=restart(), restart=restart)

    async def requests() -> list[list[str]]:
        first = await asyncio.gather(batcher.submit(["a", "b"], marker, 2), batcher.submit(["c"], marker, 1))
        after = await batcher.submit(["d"], marker, 1)
        await batcher.stop()
        return [*first, after]

    assert asyncio.run(requests()) == [["A", "B"], ["C"], ["D"]]
    assert batcher.stats["restarts"] == 1 and Path(marker).read_text() == "killed once"

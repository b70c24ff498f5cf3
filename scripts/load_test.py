"""Load test of nmt-serve against translate.py on the same sentences (loopback only, bounded).

    python scripts/load_test.py --ckpt /work/runs/m30k_eval/raw_final.ckpt \
        --input /work/shared/data/multi30k/test_2016_flickr.de --clients 200 --sentences 2000

First translates the sentences in-process with translate.py's own path (``translate_lines``, the
``decode_batches`` that ``translate.py`` runs; decoding time only, the model load excluded), then
starts ``nmt-serve`` on 127.0.0.1 (a free port) with the same decoding and thread count, and lets
``--clients`` concurrent clients send the ``--sentences`` (the input repeated as needed),
``--per-request`` sentences a request, one request after another. Every response is checked
against translate.py's output for the same sentence (identical with greedy decoding). Prints
sentences/s, p50/p99 request latency, the ratio of the two throughputs and the server's batching;
exits 1 on any error or differing translation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(ckpt: str, lines: list[str], decoding: str) -> tuple[list[str], float]:
    """translate.py's translations of ``lines`` and its decoding seconds."""
    from hydra import compose, initialize_config_dir

    from nmt import CONF_DIR, register_resolvers
    from nmt.inference.backends import open_translator

    register_resolvers()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("translate", overrides=[f"ckpt={ckpt}", f"decoding={decoding}"])
    translator = open_translator(cfg)
    start = time.perf_counter()
    out = [t.text for t in translator.translate(lines)]
    return out, time.perf_counter() - start


async def wait_healthy(http, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"nmt-serve exited with {server.returncode}")
        try:
            if (await http.get("/health")).status_code == 200:
                return
        except Exception:  # noqa: BLE001  not listening yet
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"nmt-serve answered no /health in {timeout:.0f} s")


async def load(args, lines: list[str], port: int, server: subprocess.Popen) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=args.timeout) as http:
        await wait_healthy(http, server, 120)
        await http.post("/translate", json={"text": lines[:8]})  # warm-up
        before = (await http.get("/health")).json()
        latencies: list[float] = []
        results: dict[int, str] = {}
        errors: list[str] = []

        async def client(c: int, own) -> None:
            mine = list(range(c, len(lines), args.clients))
            for k in range(0, len(mine), args.per_request):
                ids = mine[k: k + args.per_request]
                start = time.perf_counter()
                response = await own.post("/translate", json={"text": [lines[i] for i in ids]})
                latencies.append(time.perf_counter() - start)
                if response.status_code != 200:
                    errors.append(f"{response.status_code}: {response.text[:200]}")
                    continue
                rows = response.json()["translations"]
                if len(rows) != len(ids):
                    errors.append(f"{len(ids)} sentences sent, {len(rows)} translations back")
                results.update((i, row["text"]) for i, row in zip(ids, rows))

        # An httpx client per simulated user, made before the clock starts (each builds an SSL context,
        # ~10 ms): one shared pool of 200 connections costs the client process more than the server
        # spends on the requests (httpcore's pool bookkeeping).
        clients = [httpx.AsyncClient(base_url=http.base_url, timeout=args.timeout) for _ in range(args.clients)]
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*[client(c, own) for c, own in enumerate(clients)]), args.timeout)
        seconds = time.perf_counter() - start
        await asyncio.gather(*[own.aclose() for own in clients])
        after = (await http.get("/health")).json()
    return {"seconds": seconds, "latencies": latencies, "results": results, "errors": errors,
            "batches": after["batches"] - before["batches"], "requests": after["requests"] - before["requests"],
            "decode_s": after["decode_s"] - before["decode_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--input", required=True, help="source sentences, one a line (repeated to --sentences)")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--per-request", type=int, default=1, help="sentences a request")
    parser.add_argument("--decoding", default="greedy", help="greedy | beam (the serve and translate config group)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for translate.py and the server alike")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole load")
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("overrides", nargs="*", help="nmt-serve config overrides, e.g. batching.max_wait_ms=20")
    args = parser.parse_args()
    if args.sentences > 100_000 or args.clients > 1000:
        parser.error("bounded: at most 100,000 sentences and 1,000 clients")

    source = [line for line in Path(args.input).read_text(encoding="utf-8").splitlines() if line.strip()]
    lines = (source * (args.sentences // len(source) + 1))[: args.sentences]
    import torch

    torch.set_num_threads(args.threads)  # this process's own decoding; the server gets OMP_NUM_THREADS
    expected, ref_seconds = reference(args.ckpt, lines, args.decoding)

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env.pop("NMT_SERVE_API_KEY", None)  # the clients send no key to this private server
    server = subprocess.Popen([sys.executable, "-m", "nmt.serve.app", f"ckpt={args.ckpt}", "host=127.0.0.1",
                               f"port={port}", f"decoding={args.decoding}", f"limits.max_queue={args.clients * 2}",
                               *args.overrides],
                              env=env, cwd=ROOT)
    try:
        run = asyncio.run(load(args, lines, port, server))
    finally:
        server.terminate()
        server.wait(timeout=30)

    wrong = [i for i in range(len(lines)) if run["results"].get(i) != expected[i]]
    lat = sorted(run["latencies"])
    served, translated = len(lines) / run["seconds"], len(lines) / ref_seconds
    numbers = {
        "sentences": len(lines), "clients": args.clients, "per_request": args.per_request, "decoding": args.decoding,
        "threads": args.threads, "overrides": args.overrides, "serve_seconds": round(run["seconds"], 2), "serve_sentences_per_s": round(served, 1),
        "p50_ms": round(1000 * statistics.median(lat), 1), "p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 1),
        "translate_seconds": round(ref_seconds, 2), "translate_sentences_per_s": round(translated, 1),
        "ratio": round(served / translated, 3), "batches": run["batches"],
        "requests_per_batch": round(run["requests"] / max(run["batches"], 1), 1),
        "server_decoding_seconds": round(run["decode_s"], 2), "errors": len(run["errors"]), "different": len(wrong),
    }
    print(json.dumps(numbers, indent=2))
    for e in run["errors"][:5]:
        print("error:", e, file=sys.stderr)
    for i in wrong[:5]:
        print(f"different, sentence {i}: served {run['results'].get(i)!r}, translate.py {expected[i]!r}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(numbers, indent=2) + "\n")
    return 1 if run["errors"] or wrong else 0


if __name__ == "__main__":
    sys.exit(main())

"""What the heaviest requests cost nmt-serve, and what they cost the next client (loopback only).

    python scripts/serve_heavy_requests.py --ckpt <run>/checkpoints/last.ckpt \
        --input $NMT_DATA_DIR/multi30k/test_2016_flickr.de [--out results.json]

Starts ``nmt-serve`` (serve.yaml's limits, one decoding process) on 127.0.0.1 and measures:

1. a normal request (one sentence, beam 5): its latency;
2. the heaviest request the limits allowed before ``limits.max_work`` (64 sentences of 2,000
   characters, beam 16, 10 constraints each): its status and time (a 413 at once now);
3. the heaviest request ``max_work`` lets through (sentences of the input joined to about
   ``max_work / 64 / 5`` tokens each, 64 of them, beam 5): its time;
4. three of those sent by clients that disconnect after 0.3 s, then a normal request: its
   latency (the abandoned ones are dropped before their batch begins; a batch already decoding
   runs to its end).

Prints and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def post(port: int, body: dict, leave_after: float | None = None) -> tuple[int | None, float]:
    """Status and seconds of one POST /translate; ``leave_after``: close the connection then."""
    data = json.dumps(body).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()
    try:
        line = await (asyncio.wait_for(reader.readline(), leave_after) if leave_after else reader.readline())
        await reader.read()
        return int(line.split()[1]), time.perf_counter() - start
    except asyncio.TimeoutError:
        return None, time.perf_counter() - start
    finally:
        writer.close()


def sentences_of(lines: list[str], chars: int, count: int) -> list[str]:
    """``count`` sentences of about ``chars`` characters, each the input's lines joined."""
    out, i = [], 0
    for _ in range(count):
        parts: list[str] = []
        while sum(len(p) + 1 for p in parts) < chars - 120:
            parts.append(lines[i % len(lines)])
            i += 1
        out.append(" ".join(parts)[:chars])
    return out


async def measure(port: int, lines: list[str], max_work: int, tokens_per_char: float) -> dict:
    normal = {"text": [lines[0]], "beam_size": 5}
    results: dict = {"normal_s": (await post(port, normal))[1]}
    worst_before = {"text": sentences_of(lines, 2000, 64), "beam_size": 16,
                    "constraints": [[w for w in lines[j].split()[:10]] for j in range(64)]}
    status, seconds = await post(port, worst_before)
    results["worst_before_limit"] = {"status": status, "seconds": seconds}
    chars = int(max_work / 64 / 5 / tokens_per_char * 0.95)
    heavy = {"text": sentences_of(lines, min(chars, 2000), 64), "beam_size": 5}
    status, seconds = await post(port, heavy)
    results["heaviest_in_limit"] = {"status": status, "seconds": seconds, "chars_per_sentence": min(chars, 2000)}
    abandoned = [asyncio.ensure_future(post(port, heavy, leave_after=0.3)) for _ in range(3)]
    await asyncio.sleep(0.5)
    status, seconds = await post(port, normal)
    await asyncio.gather(*abandoned)
    results["normal_behind_three_abandoned"] = {"status": status, "seconds": seconds}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [line for line in args.input.read_text(encoding="utf-8").splitlines() if line.strip()]
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "nmt.serve.app", f"ckpt={args.ckpt}", f"port={port}"], cwd=ROOT)
    try:
        from nmt.inference import Translator
        from omegaconf import OmegaConf

        limits = OmegaConf.load(ROOT / "nmt" / "conf" / "serve.yaml").limits
        translator = Translator.load(args.ckpt)
        sample = " ".join(lines[:50])
        tokens_per_char = translator.count_tokens([sample]) / len(sample)
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(1)
        results = asyncio.run(measure(port, lines, int(limits.max_work), tokens_per_char))
    finally:
        server.terminate()
        server.wait(60)
    results["max_work"] = int(limits.max_work)
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

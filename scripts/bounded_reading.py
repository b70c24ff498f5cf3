"""The worst a checkpoint can cost to read, built against the limits of ``nmt.checkpoints.files``:

    python scripts/bounded_reading.py [--ckpt tests/data/saved/transformer.ckpt] [--out docs/results/bounded_reading]

Each case is the given checkpoint with one more entry under ``loops`` (training state, which every
reader reads through ``read_checkpoint``), crafted to make the most of one limit: references to
one list (operations), distinct empty lists (containers), one large byte string (structure
bytes), the same three past their limits, and lists nested 45 deep that name one list twice
each (2^45 paths: walked once). Each is read by ``read_checkpoint`` in a process of its own;
reported: the file's size, the outcome, the seconds and the process's peak memory over a read
of the plain checkpoint. Writes ``bounded_reading.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nmt.checkpoints.files import MAX_CONTAINERS, MAX_STRUCTURE_BYTES, MAX_STRUCTURE_OPS

READ = """
import re, sys, time
from pathlib import Path
from nmt.checkpoints.files import CheckpointError, read_checkpoint
start = time.perf_counter()
try:
    read_checkpoint(sys.argv[1])
    outcome = "read"
except CheckpointError as e:
    outcome = "refused: " + str(e).split(": ", 1)[1][:90]
peak_kb = re.search(r"VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)  # this process's own peak
print(outcome, time.perf_counter() - start, peak_kb, sep="\\t")
"""


def nested(depth: int) -> list:
    inner: list = [0]
    for _ in range(depth):
        inner = [inner, inner]
    return inner


def cases() -> dict[str, object]:
    ops, containers = MAX_STRUCTURE_OPS - 100_000, MAX_CONTAINERS - 50_000
    return {
        "plain checkpoint": None,
        f"{ops:,} references to one list": [[]] * ops,
        f"{containers:,} distinct empty lists": [[] for _ in range(containers)],
        f"a {(MAX_STRUCTURE_BYTES >> 20) - 2} MB byte string": b"x" * (MAX_STRUCTURE_BYTES - (2 << 20)),
        "lists nested 45 deep, each naming one list twice": nested(45),
        f"{MAX_STRUCTURE_OPS + 100_000:,} references (over the limit)": [[]] * (MAX_STRUCTURE_OPS + 100_000),
        f"{MAX_CONTAINERS + 50_000:,} empty lists (over the limit)": [[] for _ in range(MAX_CONTAINERS + 50_000)],
        f"a {(MAX_STRUCTURE_BYTES >> 20) + 1} MB byte string (over the limit)": b"x" * (MAX_STRUCTURE_BYTES + (1 << 20)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default="tests/data/saved/transformer.ckpt")
    parser.add_argument("--out", type=Path, default=Path("docs/results/bounded_reading"))
    args = parser.parse_args()
    base = torch.load(args.ckpt, weights_only=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, payload in cases().items():
            path = Path(tmp) / "crafted.ckpt"
            checkpoint = dict(base)
            if payload is not None:
                checkpoint["loops"] = {**checkpoint.get("loops", {}), "crafted": payload}
            torch.save(checkpoint, path)
            done = subprocess.run([sys.executable, "-c", READ, str(path)], capture_output=True, text=True, check=True)
            outcome, seconds, peak_kb = done.stdout.strip().split("\t")
            rows.append({"case": name, "file_mb": round(path.stat().st_size / 2**20, 1), "outcome": outcome,
                         "seconds": round(float(seconds), 2), "peak_mb": round(int(peak_kb) / 1024)})
            print(rows[-1], flush=True)
    plain = rows[0]["peak_mb"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bounded_reading.json").write_text(json.dumps({"limits": {
        "structure_bytes": MAX_STRUCTURE_BYTES, "operations": MAX_STRUCTURE_OPS, "containers": MAX_CONTAINERS},
        "rows": rows}, indent=2) + "\n")
    lines = ["| file | size (MB) | outcome | seconds | peak memory over the plain file's (MB) |", "|---|---:|---|---:|---:|"]
    lines += [f"| {r['case']} | {r['file_mb']} | {r['outcome']} | {r['seconds']} | {r['peak_mb'] - plain:+d} |" for r in rows]
    (args.out / "bounded_reading.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

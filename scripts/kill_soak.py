"""Kill soak: a small training run killed with SIGKILL at random moments and resumed each time
ends with the weights of a run that was never interrupted, bitwise; then a server killed under
load and started again answers every later request.

    python scripts/kill_soak.py --kills 24 --out outputs/kill_soak          # about 10 minutes
    python scripts/kill_soak.py --kills 24 --out outputs/kill_soak --server

The run: ``train.py`` on the synthetic data (prepared afresh), an LSTM with attention and dropout,
fp32, deterministic and on one thread (float sums depend on the thread count), ``--steps`` steps,
``last.ckpt`` every 2 steps. Each attempt is a new process in a folder of its own, resuming from
the newest ``last.ckpt`` any earlier attempt left (none: it starts over). The first attempt is
killed while it prepares the data; every later one when one of four triggers fires, drawn at
random: a delay after the start (imports, config, data; up to the time the uninterrupted run took
to its first checkpoint), the moment a preparation's temporary folder appears, the moment a
checkpoint's temporary file appears (the kill lands during or right after the write) and a delay
of up to 0.6 s after the attempt's first checkpoint (training). What was on disk when the signal
went is recorded as its phase. After ``--kills`` kills one last attempt runs to the end; its
``last.ckpt`` must equal the uninterrupted run's (weights, optimizer moments, schedule, step, best
BLEU), and no cache folder may lack its manifest (a killed preparation leaves only a ``.tmp-*``
folder, which no run reads). Writes ``<out>/kill_soak.json``; exits 1 on any difference.

``--server``: ``nmt-serve`` on the final checkpoint, 8 clients sending requests, SIGKILL after
``--server-requests`` answers, started again; every request after the restart must be answered
200 with the translation the first server gave.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TRIGGERS = ("start", "preparing", "checkpoint write", "training")


def overrides(steps: int, cache: Path) -> list[str]:
    return [
        "model=lstm_bahdanau", "model.emb_size=64", "model.hidden_size=64", "model.dropout=0.3",
        "data=synthetic", "data.source.num_pairs=3000", "data.source.valid_pairs=50", "data.source.test_pairs=50",
        "data.source.max_len=20", "data.source.median_len=8", "data.max_tokens=600", "data.val_sample=null", "data.tokenizer.vocab_size=200",
        "trainer=cpu", "trainer.precision=32-true", "trainer.deterministic=true",
        "trainer.max_epochs=-1", f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
        "trainer.check_val_every_n_epoch=null", "trainer.enable_progress_bar=false",
        "callbacks.rich_progress_bar=null", "callbacks.early_stopping=null", "callbacks.cpu_threads=null",
        "callbacks.last_checkpoint.every_n_train_steps=2", "optimizer.lr=0.01", "scheduler=cosine",
        "scheduler.warmup_steps=10", f"scheduler.total_steps={steps}", "test=false", "logger=csv",
        f"paths.cache_dir={cache}",
    ]


def train_command(steps: int, cache: Path, run_dir: Path, resume: Path | None) -> list[str]:
    command = [sys.executable, "train.py", *overrides(steps, cache), f"hydra.run.dir={run_dir}"]
    return command + ([f"ckpt_path={resume}"] if resume else [])


def on_disk(cache: Path, run_dir: Path) -> str:
    """What the process was doing, judged from its files."""
    prepared = cache / "prepared"
    if prepared.is_dir() and not any((p / "manifest.json").is_file() for p in prepared.iterdir()):
        if any(p.name.startswith(".tmp-") for p in prepared.iterdir()):
            return "preparing"
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        if any(p.name.endswith(".tmp") for p in ckpts.iterdir()):
            return "checkpoint write"
        if (ckpts / "last.ckpt").is_file():
            return "training"
    return "start"


class Trigger:
    """When to kill an attempt: ``kind`` (one of TRIGGERS) and a delay in seconds."""

    def __init__(self, kind: str, delay: float, cache: Path, run_dir: Path) -> None:
        self.kind, self.delay, self.cache, self.run_dir = kind, delay, cache, run_dir
        self.started, self.saves, self.mtime, self.saved_at = time.monotonic(), 0, None, None

    def fired(self) -> bool:
        now = time.monotonic()
        if self.kind == "start":
            return now - self.started >= self.delay
        if self.kind == "preparing":
            prepared = self.cache / "prepared"
            return prepared.is_dir() and any(p.name.startswith(".tmp-") for p in prepared.iterdir())
        ckpts = self.run_dir / "checkpoints"
        if self.kind == "checkpoint write" and ckpts.is_dir() and any(p.name.endswith(".tmp") for p in ckpts.iterdir()):
            return True
        try:
            mtime = (ckpts / "last.ckpt").stat().st_mtime_ns
        except OSError:
            return False
        if mtime != self.mtime:
            self.mtime, self.saves = mtime, self.saves + 1
            self.saved_at = self.saved_at or now
        if self.kind == "training":
            return now - self.saved_at >= self.delay  # a delay after this attempt's first checkpoint
        return self.saves >= 5  # a write too quick to be seen five times running: kill while training


def step_of(ckpt: Path | None) -> int | None:
    return None if ckpt is None else torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]


def attempt(command: list[str], log: Path, trigger: Trigger | None, cache: Path, run_dir: Path,
            timeout: float) -> dict:
    """Run ``command``; kill it when ``trigger`` fires (None: let it end)."""
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})  # one thread: the same sums every time
    killed_in, first_checkpoint = None, None
    try:
        while proc.poll() is None:
            if first_checkpoint is None and (run_dir / "checkpoints" / "last.ckpt").is_file():
                first_checkpoint = time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{' '.join(command)} ran past {timeout} s")
            if trigger is not None and trigger.fired():
                killed_in = on_disk(cache, run_dir)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {"trigger": trigger and trigger.kind, "delay_s": trigger and round(trigger.delay, 3),
            "killed": killed_in is not None, "phase": killed_in, "status": proc.returncode,
            "seconds": round(time.monotonic() - started, 2),
            "first_checkpoint_s": None if first_checkpoint is None else round(first_checkpoint, 2)}


def compare(a_path: Path, b_path: Path) -> list[str]:
    """What differs between two checkpoints (weights, optimizer moments, schedule, counters)."""
    a = torch.load(a_path, map_location="cpu", weights_only=True)
    b = torch.load(b_path, map_location="cpu", weights_only=True)
    differ = [k for k in ("global_step", "epoch", "lr_schedulers", "best_bleu") if a.get(k) != b.get(k)]
    if a["state_dict"].keys() != b["state_dict"].keys():
        return [*differ, "state_dict keys"]
    differ += [k for k in a["state_dict"] if not torch.equal(a["state_dict"][k], b["state_dict"][k])]
    for i, (p, q) in enumerate(zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values())):
        differ += [f"optimizer state {i}.{k}" for k in p if not torch.equal(p[k], q[k])]
    return differ


def soak(args) -> dict:
    out = Path(args.out).resolve()
    rng = random.Random(args.seed)
    reference_dir = out / "reference"
    ref = attempt(train_command(args.steps, out / "reference_cache", reference_dir, None), out / "reference.log",
                  None, out / "reference_cache", reference_dir, args.timeout)
    if ref["status"] != 0:
        raise SystemExit(f"the uninterrupted run failed: {out / 'reference.log'}")
    startup = ref["first_checkpoint_s"]  # "start" kills land before training: imports, config, data
    cache, resume, attempts = out / "soak_cache", None, []
    while sum(a["killed"] for a in attempts) < args.kills:
        i = len(attempts)
        run_dir = out / "soak" / f"attempt_{i:03d}"
        prepared = cache / "prepared"
        done = prepared.is_dir() and any((p / "manifest.json").is_file() for p in prepared.iterdir())
        kind = "preparing" if i == 0 else rng.choice([t for t in TRIGGERS if not (done and t == "preparing")])
        delay = rng.uniform(0.0, startup) if kind == "start" else rng.uniform(0.0, 0.6)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        record = attempt(train_command(args.steps, cache, run_dir, resume), out / "soak" / f"attempt_{i:03d}.log",
                         Trigger(kind, delay, cache, run_dir), cache, run_dir, args.timeout)
        if not record["killed"] and record["status"] != 0:
            raise SystemExit(f"attempt {i} failed with status {record['status']}: {out / 'soak' / f'attempt_{i:03d}.log'}")
        last = run_dir / "checkpoints" / "last.ckpt"
        record |= {"resumed_from_step": step_of(resume), "left_step": step_of(last) if last.is_file() else None}
        if last.is_file():
            resume = last
        attempts.append(record)
        print(f"attempt {i}: {record}", flush=True)
        if not record["killed"]:  # it ended before its trigger: the run is complete (the final attempt adds nothing)
            break
    final_dir = out / "soak" / "final"
    final = attempt(train_command(args.steps, cache, final_dir, resume), out / "soak" / "final.log",
                    None, cache, final_dir, args.timeout)
    if final["status"] != 0:
        raise SystemExit(f"the final attempt failed: {out / 'soak' / 'final.log'}")
    if (final_dir / "checkpoints" / "last.ckpt").is_file():  # none when a killed attempt had saved the last step
        resume = final_dir / "checkpoints" / "last.ckpt"
    differ = compare(reference_dir / "checkpoints" / "last.ckpt", resume)
    prepared = cache / "prepared"
    folders = sorted(p.name for p in prepared.iterdir())
    incomplete = [n for n in folders if not n.startswith(".tmp-") and not (prepared / n / "manifest.json").is_file()]
    phases: dict[str, int] = {}
    for a in attempts:
        if a["killed"]:
            phases[a["phase"]] = phases.get(a["phase"], 0) + 1
    return {"steps": args.steps, "kills": sum(a["killed"] for a in attempts), "kills_by_phase": phases,
            "attempts": attempts, "final_checkpoint": str(resume), "final_step": step_of(resume),
            "differences": differ, "bitwise_equal": not differ,
            "cache_folders": folders, "incomplete_cache_folders": incomplete,
            "command": " ".join(["python", "train.py", *overrides(args.steps, Path("<cache>"))])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, texts: list[str], timeout: float = 60) -> tuple[int, list[str] | None]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/translate", data=json.dumps({"text": texts}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, [t["text"] for t in json.loads(answer.read())["translations"]]
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, http.client.HTTPException):
        return 0, None  # no connection, or it ended mid-answer: the server is down


def start_server(ckpt: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NMT_SERVE_API_KEY", None)
    with log.open("a") as out:
        server = subprocess.Popen([sys.executable, "-m", "nmt.serve.app", f"ckpt={ckpt}", "host=127.0.0.1",
                                   f"port={port}", "decoding=greedy"], cwd=ROOT, env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"nmt-serve exited with {server.returncode}: {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return server
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"nmt-serve did not answer /health within 300 s: {log}")


def server_soak(args, ckpt: Path) -> dict:
    out = Path(args.out).resolve()
    texts = [f"sentence {i} " + " ".join(["ba", "ko", "ti", "nu"][: 1 + i % 4]) for i in range(40)]
    port, log = free_port(), out / "server.log"
    server = start_server(ckpt, port, log)
    status, expected = post(port, texts)
    if status != 200:
        raise SystemExit(f"the first server answered {status}")
    answered, during = 0, []
    with ThreadPoolExecutor(8) as pool:
        pending = [pool.submit(post, port, [texts[i % len(texts)]]) for i in range(args.server_requests * 4)]
        for future in pending:
            if answered == args.server_requests and server.poll() is None:
                server.send_signal(signal.SIGKILL)  # under load: requests still in flight
                server.wait()
            result = future.result()
            during.append(result[0])
            answered += result[0] == 200
    server = start_server(ckpt, port, log)
    try:
        with ThreadPoolExecutor(8) as pool:
            after = list(pool.map(lambda i: post(port, [texts[i % len(texts)]]), range(args.server_requests)))
    finally:
        server.terminate()
        server.wait(timeout=30)
    wrong = [i for i, (code, got) in enumerate(after) if code != 200 or got != [expected[i % len(texts)]]]
    return {"requests_before_the_kill": args.server_requests, "statuses_around_the_kill": {
        str(code): during.count(code) for code in sorted(set(during))},
        "requests_after_the_restart": len(after), "answered_after_the_restart": len(after) - len(wrong),
        "wrong_after_the_restart": wrong}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=24)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600, help="seconds one attempt may run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--server", action="store_true", help="also kill a server under load and restart it")
    parser.add_argument("--server-requests", type=int, default=40)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise SystemExit(f"--out {out} is not empty: give a new folder")
    result = soak(args)
    if args.server:
        result["server"] = server_soak(args, Path(result["final_checkpoint"]))
    (out / "kill_soak.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "attempts"}, indent=1))
    ok = result["bitwise_equal"] and not result["incomplete_cache_folders"]
    ok = ok and (not args.server or not result["server"]["wrong_after_the_restart"])
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

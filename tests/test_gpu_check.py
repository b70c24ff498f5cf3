"""scripts/gpu_check.sh: the dry run (the GPU check's code on the CPU, tiny) writes a complete
report; on a machine with CUDA the same tiny run goes through the CUDA paths."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

PARTS = ["env", "data", "presets", "base", "checkpointing", "kv_cache", "parity", "attention", "sdpa"]
SECTIONS = ["## 1. Environment", "## 2. Presets", "## 3. transformer_base", "## 4. Attention", "## 5. Gradient checkpointing",
            "## 6. Beam search", "## 7. Loss parity", "## 8. Attention patterns", "## The seeds' claims", "## Timings"]


def run_check(out: Path, *args: str) -> tuple[dict, str]:
    result = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out), *args],
                            capture_output=True, text=True, cwd=ROOT, timeout=3600,  # a hang guard only
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all parts ok" in result.stdout
    reports = sorted(out.glob("*.json"))
    assert len(reports) == 1 and reports[0].with_suffix(".md").is_file(), sorted(out.iterdir())
    assert not list(out.glob("*.tmp"))
    return json.loads(reports[0].read_text()), reports[0].with_suffix(".md").read_text()


def table(md: str, header: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header line starts with ``header``."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    names = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(names, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def number(cell: str) -> float:
    match = re.fullmatch(r"-?[\d,]*\.?\d+(e[-+]?\d+)?%?", cell)
    assert match, cell
    return float(cell.rstrip("%").replace(",", ""))


def check_report(report: dict, md: str) -> None:
    assert list(report["parts"]) == PARTS
    for key, part in report["parts"].items():
        assert part["status"] == "ok", (key, part.get("error"), part.get("traceback"))
    for section in SECTIONS:
        assert section in md, section
    for key in ("matmul_peak_bfloat16", "matmul_peak_float16"):
        assert report["parts"]["env"]["result"][key] > 0

    runs = report["parts"]["presets"]["result"]["runs"]
    assert {(r["model"], r["precision"], r["variant"]) for r in runs} == {
        (m, "bf16-mixed", v) for m in ("lstm", "lstm_bahdanau", "lstm_luong", "transformer") for v in ("eager", "compiled")
    } | {("transformer", "bf16-mixed", "cudagraphs"), ("transformer", "32-true", "eager")}
    base_runs = report["parts"]["base"]["result"]["runs"]
    assert [r["variant"] for r in base_runs] == ["eager", "compiled", "auto batch"]
    for r in [*runs, *base_runs]:
        assert r["steps"] == report["mode"]["steps"] and r["timed_batches"] >= 1, r
        assert r["tgt_tokens_per_s"] > 0 and r["flops_per_s"] > 0 and r["loss_finite"], r
        assert r["peak_fraction"] is None if r["precision"] == "32-true" else 0 < r["peak_fraction"], r  # no fp32 peak
        if r["variant"] == "eager":  # today's path: eager, each batch its own shape
            assert r["compile"] is None and r["shapes"] == "exact", r
        else:  # compiled (a dry run traces) on shape buckets: a few graphs for many batches; a later run of
            assert r["shapes"] == "buckets" and r["compile"]["graphs"] <= 4, r  # a model finds them compiled
            assert 1 <= r["compile"]["batch_shapes_per_epoch"] <= 40, r
    compiled = {r["model"]: r["compile"]["graphs"] for r in [*runs, *base_runs] if r["variant"] == "compiled"}
    assert compiled.pop("lstm") == 0 and all(graphs >= 1 for graphs in compiled.values()), compiled  # the plain
    # LSTM, nn.LSTM calls alone, compiles nothing
    presets, base = table(md, "| model | precision |"), table(md[md.index("## 3."):], "| model | precision |")
    assert len(presets) == 10 and [row["model"] for row in base] == ["transformer_base"] * 3
    for row in presets + base:
        assert number(row["target tok/s"]) > 0 and math.isfinite(number(row["final loss"]))
        assert row["% of peak"] == "–" if row["precision"] == "32-true" else number(row["% of peak"]) >= 0
    assert "Target tokens/s against eager bf16: lstm compiled" in md

    sdpa = report["parts"]["sdpa"]["result"]
    assert sdpa["model_forward_backward"]["MATH"] == "ok" and sdpa["backends_ran"]

    memory = report["parts"]["checkpointing"]["result"]["runs"]
    assert [r["model"] for r in memory] == ["transformer_base", "lstm_bahdanau"]
    assert memory[0]["on"]["saved_mb"] < memory[0]["off"]["saved_mb"]  # checkpointing keeps less for backward
    for row in table(md, "| model | steps (tokens) |"):
        assert number(row["peak MB off"]) > 0 and number(row["saved for backward MB off"]) > 0

    kv = report["parts"]["kv_cache"]["result"]["runs"]
    assert [r["model"] for r in kv] == ["transformer", "transformer_base"] and all(r["speedup"] > 0 for r in kv)
    for r in kv:  # every engine decoded the batch; in fp32 graphs gave the loop's hypotheses, captured and
        # replayed (bf16's share of equal outputs is reported, not held); CTranslate2 (float32 on a CPU) decoded it too
        assert set(r["engines"]) == {"loop", "graphs", "no_cache"} and not r["fell_back"], r
        assert r["fp32"]["sentences"] == r["sentences"] and r["fp32"]["differing"] == [0, 0], r["fp32"]
        assert r["fp32"]["max_score_rel_diff"] <= r["fp32"]["score_tolerance"], r["fp32"]
        assert r["ctranslate2"]["tokens_per_s"] > 0 and r["against_ctranslate2"] > 0, r["ctranslate2"]
        loop, graphs = r["engines"]["loop"]["host"], r["engines"]["graphs"]["host"]
        assert graphs["reads_per_step"] < loop["reads_per_step"] and graphs["ops_per_step"] > 0, (loop, graphs)
    assert len(table(md, "| model | loop: operators / launches / reads per step |")) == 2
    claims = table(md, "| claim |")
    assert [c["from"] for c in claims] == ["part 2", "part 2", "part 5", "part 5", "part 2"], claims
    for row in table(md, "| model | weights |"):
        assert number(row["cache factor (graphs / no cache)"].rstrip("x")) > 0
    assert "In fp32 (TF32 off) `graphs` gave the loop's hypotheses, for a first search and for a replay" in md

    patterns = report["parts"]["attention"]["result"]["summary"]
    assert list(patterns) == ["full", "local", "local_global", "block_sparse", "low_rank"]
    rows = report["parts"]["attention"]["result"]["rows"]
    assert len(rows) == 5 * 3 and all(r["layer_backward_s"] > 0 and r["layer_saved_mb"] > 0 for r in rows)

    parity = report["parts"]["parity"]["result"]
    assert parity["passed"] and len(parity["runs"]) == 4
    for row in table(md, "| model | CPU fp32 reference |"):
        assert row["pass"] == "pass" and number(row["rel. diff"]) <= parity["tolerance"]["fp32"]
        assert number(row["CPU fp32 reference"]) > 0


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_dry_run_writes_every_part(tmp_path):
    report, md = run_check(tmp_path / "report")
    assert report["dry_run"] and report["mode"]["device"] == "cpu"
    check_report(report, md)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_run_on_cuda(tmp_path):
    report, md = run_check(tmp_path / "report", "--device", "cuda")
    check_report(report, md)
    assert report["parts"]["env"]["result"]["gpu"]
    for r in report["parts"]["presets"]["result"]["runs"]:
        assert r["ran_as"] == r["precision"]
    probe = report["parts"]["base"]["result"]["runs"][2]["batch_probe"]
    assert probe["max_tokens"] >= 1024 and probe["tries"], probe
    assert report["parts"]["sdpa"]["result"]["profiled_kernels"], "the profiler saw no attention kernel"

"""scripts/first_runs.py: each preset's ``train.py model=<m>`` timed to its exit, one table of
steps and test BLEU by source length read from the runs' own files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import KERNELS, ROOT, TINY

SCRIPT = ROOT / "scripts" / "first_runs.py"


def tiny_run(tmp_path) -> list[str]:
    """Overrides that make each first run two steps of a tiny model."""
    return [o for o in TINY if not o.startswith("model.")] + [
        "model.emb_size=16", "model.hidden_size=16", "trainer.max_steps=2", "test_decoding.beam_size=2",
        f"kernels={KERNELS[0]}", f"paths.cache_dir={tmp_path / 'cache'}"]


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_first_runs_times_each_preset_and_tabulates_its_report(tmp_path):
    overrides = tiny_run(tmp_path)
    out = tmp_path / "first"
    result = subprocess.run([sys.executable, str(SCRIPT), "--models", "lstm", "transformer", "--out", str(out), *overrides],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((out / "first_runs.json").read_text())
    assert [r["model"] for r in rows] == ["lstm", "transformer"]
    for r in rows:
        report = json.loads((out / r["model"] / "bleu_by_length.json").read_text())
        assert r["steps"] == 2 and r["bleu"] == report["bleu"] and r["wall_seconds"] > 0
        assert r["command"].startswith(f"train.py model={r['model']} ")
        assert r["precision"] == "32-true"  # as TINY sets
    table = (out / "first_runs.md").read_text()
    assert table.count("| `python train.py model=") == 2 and "| 1-10 |" in table and table.count("| quiet |") == 2
    # --collect tabulates the finished runs again, without training
    again = subprocess.run([sys.executable, str(SCRIPT), "--collect", str(out), "--models", "lstm", "transformer"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == table


def test_collect_names_the_folder_without_finished_runs(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--collect", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode != 0
    assert f"{tmp_path}: no finished first run (<model>/wall_seconds.json) to collect" in result.stderr


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_busy_runs_beside_a_competitor_and_say_so(tmp_path):
    overrides = tiny_run(tmp_path)
    out = tmp_path / "busy"
    result = subprocess.run([sys.executable, str(SCRIPT), "--busy", "--models", "lstm", "--out", str(out), *overrides],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads((out / "first_runs.json").read_text())
    assert row["busy"] is True and row["steps"] == 2 and row["tgt_tokens_per_sec"] > 0
    assert "| busy (`yes`) |" in (out / "first_runs.md").read_text()

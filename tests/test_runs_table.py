"""nmt-runs: a multirun folder's finished runs in one table, best first; bad input in one line."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from nmt.runs_table import collect, write


def fake_run(folder: Path, overrides: list[str], metrics: dict[str, float], steps: int = 10,
             ended_by: str = "max_steps") -> None:
    """A run folder as ``nmt.train`` leaves it, as far as the table reads it."""
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({
        "overrides": overrides, "parameters": 1234, "train_tokens_per_sec": 500.0, "fit_seconds": 90.0,
        "steps": steps, "max_steps": 10, "ended_by": ended_by, "metrics": {"train/loss": 1.0, **metrics}}))


def runs_folder(tmp_path: Path) -> Path:
    sweep = tmp_path / "multirun"
    fake_run(sweep / "0", ["model=lstm"], {"val/bleu_best": 10.0, "test/bleu": 9.51234})
    fake_run(sweep / "1", ["model=transformer"], {"val/bleu_best": 30.0, "test/bleu": 28.0})
    fake_run(sweep / "2", ["model=lstm_luong"], {"val/bleu_best": float("nan")})  # diverged: last
    (sweep / "3").mkdir()  # a run that has not finished: no summary.json
    return sweep


def nmt_runs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nmt.runs_table", *args], capture_output=True, text=True, timeout=120)


def test_the_table_sorts_finished_runs_by_the_metric(tmp_path):
    sweep = runs_folder(tmp_path)
    rows = collect(sweep)
    assert [r["run"] for r in rows] == ["1", "0", "2"]
    assert rows[1]["test/bleu"] == 9.512 and rows[1]["fit_minutes"] == 1.5 and "train/loss" not in rows[1]
    assert [r["run"] for r in collect(sweep, "test/bleu")] == ["1", "0", "2"]
    csv_path, md_path = write(rows, sweep, "val/bleu_best")
    assert [r["run"] for r in csv.DictReader(csv_path.open())] == ["1", "0", "2"]
    lines = md_path.read_text().splitlines()
    assert lines[0] == ("| run | overrides | val/bleu_best | test/bleu | steps | ended_by | parameters | "
                        "train_tokens_per_sec | fit_minutes |")
    assert lines[2] == "| 1 | model=transformer | 30.0 | 28.0 | 10 | max_steps | 1234 | 500.0 | 1.5 |"
    assert len(lines) == 5  # no run was pruned: no pruning line


def test_a_pruned_sweep_says_what_pruning_saved(tmp_path):
    sweep = runs_folder(tmp_path)
    fake_run(sweep / "4", ["model=lstm", "optimizer.lr=1"], {"val/bleu_best": 1.0}, steps=4, ended_by="pruned")
    fake_run(sweep / "5", ["model=lstm", "optimizer.lr=2"], {"val/bleu_best": 0.5}, steps=2, ended_by="pruned")
    _, md_path = write(collect(sweep), sweep, "val/bleu_best")
    lines = md_path.read_text().splitlines()
    assert lines[-1] == "pruned: 2 of 5 runs; 36 of 50 budgeted steps trained (28% saved)"


def test_the_command_prints_the_table_and_refuses_bad_input_in_one_line(tmp_path):
    sweep = runs_folder(tmp_path)
    result = nmt_runs(str(sweep))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (sweep / "runs.md").read_text().strip()
    assert nmt_runs("--help").stdout.startswith("usage: nmt-runs")
    cases = {
        str(tmp_path / "missing"): f"nmt-runs: {tmp_path / 'missing'}: no such folder",
        str(sweep / "3"): f"nmt-runs: no summary.json under {sweep / '3'}: no run there has finished",
    }
    (tmp_path / "broken" / "a").mkdir(parents=True)
    (tmp_path / "broken" / "a" / "summary.json").write_text('{"steps": 3}')
    cases[str(tmp_path / "broken")] = f"nmt-runs: {tmp_path / 'broken' / 'a' / 'summary.json'}: not a run summary (no 'parameters')"
    for folder, message in cases.items():
        result = nmt_runs(folder)
        assert (result.returncode, result.stderr.strip()) == (1, message)
    result = nmt_runs(str(sweep), "--metric", "val/blue")
    assert result.stderr.strip() == "nmt-runs: no run has the metric 'val/blue' (they have: test/bleu, val/bleu_best)"

"""A sweep through Hydra's submitit launcher in local mode: the code path of
`hydra/launcher=slurm` (each job pickled, started by submitit in a process of its own, its
result read back), without a cluster."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import KERNELS, ROOT, TINY

pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                    reason="needs hydra-submitit-launcher: pip install -e '.[slurm]' (or '.[test]')")

HANG_GUARD = 300  # seconds


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_submitit_local_sweep_runs_every_job(tmp_path):
    """Two jobs (two models) run through `hydra/launcher=local`; each writes its own summary."""
    sweep = tmp_path / "sweep"
    command = [sys.executable, "train.py", "-m", "hydra/launcher=local", *TINY, f"kernels={KERNELS[0]}",
               "model=lstm,lstm_bahdanau", "trainer.max_steps=2", "trainer.max_epochs=-1", "test=false",
               f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.sweep.dir={sweep}"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(sweep.glob(".submitit/*/*_log.err")))
    assert result.returncode == 0, result.stderr[-3000:] + logs
    overrides = []
    for job in (0, 1):
        summary = json.loads((sweep / str(job) / "summary.json").read_text())
        assert summary["steps"] == 2
        overrides.append(summary["overrides"])
    assert [o for job in overrides for o in job if o.startswith("model=")] == ["model=lstm", "model=lstm_bahdanau"]
    assert len(list(sweep.glob(".submitit/*/*_result.pkl"))) == 2  # submitit ran both jobs and read their results

"""The built wheel works on its own: installed into a fresh virtual environment, its commands
train and translate from an empty folder (configs ship inside the package)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

TINY_RUN = [
    "model=transformer", "trainer=cpu", "data.source.num_pairs=200", "data.source.valid_pairs=10",
    "data.source.test_pairs=10", "data.tokenizer.vocab_size=120", "model.hidden_size=16", "model.emb_size=16",
    "model.encoder.num_layers=1", "model.decoder.num_layers=1", "model.encoder.num_heads=2",
    "model.decoder.num_heads=2", "model.encoder.ff_size=32", "model.decoder.ff_size=32",
    "trainer.max_steps=3", "trainer.max_epochs=-1", "callbacks.rich_progress_bar=null", "test_decoding.beam_size=2",
]


def run(cmd: list, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NMT_CACHE_DIR", "PROJECT_ROOT")}
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
                            **kwargs)
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_the_wheel_installs_into_a_fresh_environment_and_trains_from_an_empty_folder(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "nmt", src / "nmt", ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src],
        cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("nmt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"nmt/conf/serve.yaml", "nmt/serve/static/index.html", "nmt/serve/static/app.js"} <= set(names)
    # nothing shipped points into a checkout's tests/: no config names a path there (data=tiny lives in
    # tests/conf), no file the tests' corpora or configs (comments may still name a test file)
    assert "nmt/conf/data/tiny.yaml" not in names
    with zipfile.ZipFile(wheel) as archive:
        for name in names:
            text = archive.read(name).decode("utf-8", errors="replace")
            assert "tests/data/" not in text and "tests/conf/" not in text, name
            assert not name.endswith(".yaml") or "tests/" not in text, name

    # A fresh environment with the wheel alone; its dependencies come from this one's site-packages
    # (a .pth line adds the folder but runs none of its .pth files, so this nmt stays invisible).
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "outer_site_packages.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel], cwd=tmp_path)

    work = tmp_path / "work"
    work.mkdir()
    where = run([python, "-c", "import nmt; print(nmt.__file__, nmt.CONF_DIR)"], cwd=work).stdout
    assert str(site) in where and "conf" in where, where
    run([bin_dir / "nmt-train", *TINY_RUN], cwd=work)
    (ckpt,) = (work / "outputs" / "train" / "runs").glob("*/checkpoints/last.ckpt")
    assert (work / ".cache").is_dir()
    out = run([bin_dir / "nmt-translate", f"ckpt={ckpt}", "decoding=greedy"], cwd=work, input="a b c\n\nd e\n").stdout
    assert len(out.split("\n")) == 4 and out.split("\n")[1] == ""
    run([bin_dir / "nmt-export", f"ckpt={ckpt}", f"out={work / 'model.ckpt'}"], cwd=work)
    assert (work / "model.ckpt").is_file()

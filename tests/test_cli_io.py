"""``nmt.cli_io.hydra_command``, the ``main`` of every Hydra command: Hydra composes the command's
config with the command line, the job is named after the command's own module (its ``--help``, its
log file), a user's error in the work is one line and status 2, and the set-up runs first, outside
that. A stand-in command over ``nmt/conf/cache.yaml`` (it writes no run folder), in processes of
its own: Hydra reads ``sys.argv``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

COMMAND = '''
from nmt.cli_io import check_output_folder, hydra_command


def set_up(cfg):
    print("set up", flush=True)
    if cfg.get("fail") == "set_up":
        raise ValueError("a set-up error keeps its traceback")


def work(cfg):
    print("work: prune", cfg.prune, flush=True)
    if cfg.get("fail") == "work":
        check_output_folder("/nonexistent/folder/out.txt")  # a ValueError raised in nmt's code
    return 1.0


main = hydra_command("cache", work, set_up)

if __name__ == "__main__":
    main()
'''


@pytest.fixture(scope="module")
def command(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("command") / "probe_command.py"
    path.write_text(COMMAND)
    return path


def run(command: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(command), *args], capture_output=True, text=True, timeout=120,
                          cwd=command.parent, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def test_the_command_composes_its_config_with_the_overrides_and_runs_its_work(command):
    result = run(command, "prune=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["set up", "work: prune True"]


def test_the_job_is_named_after_the_commands_module(command):
    help_text = run(command, "--help")
    assert help_text.returncode == 0 and help_text.stdout.startswith("probe_command is powered by Hydra.")
    hydra = run(command, "--cfg", "hydra").stdout
    assert "\n    name: probe_command\n" in hydra, hydra[-3000:]


def test_a_users_error_in_the_work_is_one_line_and_status_2(command):
    result = run(command, "+fail=work")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == ["error: output=/nonexistent/folder/out.txt: its folder /nonexistent/folder "
                                          "does not exist; create the folder or write elsewhere"]


def test_the_set_up_runs_outside_the_clean_ending(command):
    result = run(command, "+fail=set_up")
    assert result.returncode == 1 and "work" not in result.stdout
    assert "ValueError: a set-up error keeps its traceback" in result.stderr, result.stderr[-3000:]

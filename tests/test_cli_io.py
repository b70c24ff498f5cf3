"""``nmt.cli_io.hydra_command``, the ``main`` of every Hydra command: Hydra composes the command's
config with the command line, the job is named after the command's own module (its ``--help``, its
log file), a user's error in the work is one line and status 2, and the set-up runs first, outside
that. A stand-in command over ``nmt/conf/cache.yaml`` (it writes no run folder), in processes of
its own: Hydra reads ``sys.argv``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
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


# --- a first signal during any command's load: stopped within the grace --------------------------
# Each command with its load replaced by one that never lets go (it swallows whatever a signal raises
# in it, as a library's ``except BaseException`` or torch's C++ would keep it): the first SIGINT or
# SIGTERM ends the process STOP_GRACE seconds later, 128 + signal, one line, and no output file.
STAND_IN = '''
import importlib, sys, time

command, module, target, *args = sys.argv[1:]


def load_that_never_ends(*_, **__):
    print("loading", file=sys.stderr, flush=True)
    while True:
        try:
            time.sleep(600)
        except BaseException:
            pass


where, name = target.split(":")
owner = importlib.import_module(where)
*path, attribute = name.split(".")
for part in path:
    owner = getattr(owner, part)
setattr(owner, attribute, load_that_never_ends)
sys.argv = [command, *args]
importlib.import_module(module).main()
'''
SAVED = ROOT / "tests" / "data" / "saved" / "transformer.ckpt"
TINY_DATA = ROOT / "tests" / "data" / "tiny"
LOADS = {  # command: its module, the load replaced, the signal sent, its arguments ({out}: what it would write)
    "nmt-evaluate": ("nmt.evaluate", "nmt.inference.translator:Translator.load", "SIGINT", [f"ckpts=[{SAVED}]"]),
    "nmt-export": ("nmt.export", "nmt.export:read_checkpoint", "SIGTERM", [f"ckpt={SAVED}", "format=release",
                                                                           "out={out}"]),
    "nmt-average": ("nmt.average", "nmt.average:read_checkpoint", "SIGINT", [f"ckpts=[{SAVED},{SAVED}]", "out={out}"]),
    "nmt-import": ("nmt.import_model", "nmt.import_model:import_folder", "SIGTERM", ["src={tmp}/marian", "out={out}"]),
    "nmt-prune": ("nmt.prune", "nmt.inference.translator:Translator.load", "SIGTERM", [f"ckpt={SAVED}", "out={tmp}/pruned"]),
    "nmt-serve": ("nmt.serve.app", "nmt.serve.app:open_translator", "SIGINT", [f"ckpt={SAVED}"]),
    "nmt-distill": ("nmt.distill", "nmt.training.distillation:_open_teacher", "SIGINT",
                    [f"distill.teacher={SAVED}", "data=files", f"data.source.path={TINY_DATA}", "data.src_lang=src",
                     "data.tgt_lang=tgt", "model=transformer", "distill.backend=torch", "trainer=cpu"]),
    "nmt-train": ("nmt.train", "nmt.train:read_init_from", "SIGTERM", [f"init_from={SAVED}", "trainer=cpu"]),
}


def stop_each_load(root: Path, commands: dict = LOADS, limit: float = 300) -> dict[str, tuple[int, float, str, bool]]:
    """Start every command at once, send its signal when its load has begun; per command the exit
    status, the seconds from the signal to the exit (inf: still running after ``limit`` seconds, then
    killed), its stderr and whether its output exists."""
    started = {}
    for command, (module, target, signum, args) in commands.items():
        tmp = root / command
        tmp.mkdir()
        out = tmp / "out.ckpt"
        args = [a.format(out=out, tmp=tmp) for a in args]
        stderr = open(tmp / "stderr.txt", "w")
        proc = subprocess.Popen([sys.executable, "-c", STAND_IN, command, module, target, *args,
                                 f"paths.log_dir={tmp}/logs", f"paths.cache_dir={tmp}/cache", f"hydra.run.dir={tmp}/run"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp)
        started[command] = (proc, stderr, tmp, out, getattr(signal, signum))
    sent: dict[str, float] = {}
    ended: dict[str, float] = {}
    deadline = time.monotonic() + limit
    try:
        while len(ended) < len(started) and time.monotonic() < deadline:
            for command, (proc, _, tmp, _, signum) in started.items():
                if command not in sent and "loading" in (tmp / "stderr.txt").read_text():
                    proc.send_signal(signum)
                    sent[command] = time.monotonic()
                if command not in ended and proc.poll() is not None:
                    ended[command] = time.monotonic()
            time.sleep(0.02)
    finally:
        for proc, stderr, *_ in started.values():
            proc.kill()
            proc.wait()
            stderr.close()
    return {command: (proc.returncode, ended.get(command, float("inf")) - sent.get(command, float("inf")),
                      (tmp / "stderr.txt").read_text(), out.exists())
            for command, (proc, _, tmp, out, _) in started.items()}


SLOW_LOADS = ("nmt-evaluate", "nmt-prune", "nmt-serve", "nmt-distill", "nmt-train")  # 2-5 s of imports each


@pytest.fixture(scope="module")
def stopped_loads(tmp_path_factory) -> dict[str, tuple[int, float, str, bool]]:
    return stop_each_load(tmp_path_factory.mktemp("loads"), {c: v for c, v in LOADS.items() if c not in SLOW_LOADS})


@pytest.fixture(scope="module")
def stopped_slow_loads(tmp_path_factory) -> dict[str, tuple[int, float, str, bool]]:
    return stop_each_load(tmp_path_factory.mktemp("slow_loads"), {c: v for c, v in LOADS.items() if c in SLOW_LOADS})


@pytest.mark.slow  # a process per command, each held 3 s: the slow tier (translate.py's grace runs by default)
@pytest.mark.parametrize("command", LOADS)
def test_a_first_signal_during_a_commands_load_stops_it_within_the_grace(request, command):
    """The commands start at once (a fixture per tier), so the tier waits one grace, not one each."""
    from nmt.cli_io import STOP_GRACE

    status, took, errors, written = request.getfixturevalue(
        "stopped_slow_loads" if command in SLOW_LOADS else "stopped_loads")[command]
    signum = getattr(signal, LOADS[command][2])
    assert status == 128 + signum and "Traceback" not in errors, errors[-3000:]
    assert errors.splitlines()[-1] == (f"stopped by {signal.Signals(signum).name}: the file being read or loaded did "
                                       f"not let go within {STOP_GRACE:g} s; nothing was written")
    assert STOP_GRACE - 0.5 < took < STOP_GRACE + 5 and not written


def test_a_signal_during_a_load_that_ends_stops_the_command_as_the_load_ends(capsys):
    """The load is not cut short (nothing is raised inside it); the command stops as it ends, and
    the handlers from before are back."""
    import os

    from nmt.cli_io import ending_cleanly, stop_within_grace

    before = signal.getsignal(signal.SIGTERM)
    done = []
    with pytest.raises(SystemExit) as stop, ending_cleanly():
        with stop_within_grace():
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("the rest of the load")
        done.append("the work after it")
    assert stop.value.code == 143 and done == ["the rest of the load"]
    assert capsys.readouterr().err == "stopped by SIGTERM; nothing was written\n"
    assert signal.getsignal(signal.SIGTERM) is before

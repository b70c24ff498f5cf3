"""translate.py never destroys or hides its input: an output that is an input is refused, an error
before the first line leaves an existing output as it was, signals and a closed stdout end the run
with whole lines written, no traceback and a conventional exit status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from nmt.decoding.search import search_of
from nmt.decoding.settings import SearchSettings
from omegaconf import OmegaConf

from nmt.checkpoints.loading import load_checkpoint
from nmt.train import train
from nmt.inference.translator import translate_lines
from nmt.decoding.limits import model_max_src_len
from tests.conftest import CONF_DIR, ROOT, compose_train

LINES = (ROOT / "tests/data/tiny/train.src").read_text(encoding="utf-8").splitlines()
OLD = "an earlier translation\nthat must survive\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny LSTM after one epoch (its translations run long, so a run is easy to stop midway)."""
    tmp_path = tmp_path_factory.mktemp("safety")
    cfg = compose_train(tmp_path, ["test=false"])
    train(cfg)
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


def command(ckpt: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "translate.py"), f"ckpt={ckpt}", "decoding=greedy", *overrides]


def translate(ckpt: Path, cwd: Path, *overrides: str, stdin: Path | None = None) -> tuple[int, str]:
    """translate.py in a process of its own: (exit status, stderr)."""
    with open(stdin or os.devnull, "rb") as f:
        result = subprocess.run(command(ckpt, *overrides), stdin=f, capture_output=True, text=True, cwd=cwd,
                                timeout=600)
    return result.returncode, result.stderr


def translate_here(ckpt: Path, capsys, *overrides: str) -> tuple[int, str]:
    """The same run in this process (what ``nmt.translate.main`` runs, without Hydra's command
    line): faster, for the errors raised before any line is translated."""
    from nmt.cli_io import ending_cleanly
    from nmt.translate import translate_until_stopped

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("translate", overrides=[f"ckpt={ckpt}", "decoding=greedy", *overrides])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop, ending_cleanly():
        translate_until_stopped(cfg)
    return stop.value.code, capsys.readouterr().err


def assert_one_line_error(result: tuple[int, str], *expected: str) -> None:
    status, stderr = result
    assert status == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and all(e in errors[0] for e in expected), stderr[-3000:]


@pytest.fixture
def src(tmp_path) -> Path:
    path = tmp_path / "in.txt"
    path.write_text("\n".join(LINES[:5]) + "\n", encoding="utf-8")
    return path


# --- the output is never an input ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["same_path", "symlink", "hard_link", "stdin", "score_target", "checkpoint"])
def test_an_output_that_is_an_input_is_refused_and_the_file_is_unchanged(ckpt, src, tmp_path, capsys, how):
    before = src_before = src.read_bytes()
    output, overrides, stdin, names = src, [f"input={src}"], None, [f"input={src}"]
    if how == "symlink":
        output = tmp_path / "link.txt"
        output.symlink_to(src)
    elif how == "hard_link":
        output = tmp_path / "hard.txt"
        os.link(src, output)
    elif how == "stdin":
        overrides, stdin, names = [], src, ["stdin"]
    elif how == "score_target":
        target = tmp_path / "hyps.txt"
        target.write_bytes(before)
        output, before = target, target.read_bytes()
        overrides, names = ["mode=score", f"input={src}", f"target={target}"], [f"target={target}"]
    elif how == "checkpoint":  # the model file itself
        copy = tmp_path / "model.ckpt"
        copy.write_bytes(Path(ckpt).read_bytes())
        ckpt, output, before = copy, copy, copy.read_bytes()
        names = [f"ckpt={copy}"]
    if how in ("same_path", "stdin"):  # the command line end to end
        result = translate(ckpt, tmp_path, *overrides, f"output={output}", stdin=stdin)
    else:
        result = translate_here(ckpt, capsys, *overrides, f"output={output}")
    assert_one_line_error(result, f"output={output} is the same file as", *names)
    assert output.read_bytes() == before and src.read_bytes() == src_before


# --- an error before the first line leaves the output as it was ----------------------------------
@pytest.mark.parametrize("case", ["missing_input", "bad_checkpoint", "bad_format", "nbest_over_beam"])
def test_an_error_before_the_first_line_leaves_an_existing_output_unchanged(ckpt, src, tmp_path, capsys, case):
    out = tmp_path / "out.txt"
    out.write_text(OLD, encoding="utf-8")
    overrides, expected = [f"input={src}"], []
    if case == "missing_input":
        missing = tmp_path / "missing.txt"
        overrides, expected = [f"input={missing}"], [f"input={missing}", "No such file"]
    elif case == "bad_checkpoint":
        bad = tmp_path / "bad.ckpt"
        bad.write_bytes(b"PK\x03\x04 half a checkpoint")
        ckpt, expected = bad, [str(bad)]
    elif case == "bad_format":
        overrides, expected = [*overrides, "format=tsv"], ["format=tsv"]
    else:
        overrides, expected = [*overrides, "decoding=beam", "decoding.beam_size=2", "decoding.nbest=3"], ["nbest=3"]
    if case == "missing_input":
        result = translate(ckpt, tmp_path, *overrides, f"output={out}")
    else:
        result = translate_here(ckpt, capsys, *overrides, f"output={out}")
    assert_one_line_error(result, *expected)
    assert out.read_text(encoding="utf-8") == OLD


@pytest.mark.parametrize("bad", ["cr_only", "invalid_utf8_later"])
def test_an_input_error_found_while_translating_leaves_an_existing_output_unchanged(ckpt, tmp_path, capsys, bad):
    """The reader finds a bad line only once it reaches it, after the output was opened: the
    output is written under a temporary name, so the old file stays whole and nothing is left."""
    out = tmp_path / "out.txt"
    out.write_text(OLD, encoding="utf-8")
    out.chmod(0o640)
    src = tmp_path / "in.txt"
    src.write_bytes(b"a b c\rd e f\r" if bad == "cr_only" else "".join(line + "\n" for line in LINES * 4).encode()
                    + b"\xff\xfe broken\n")  # hundreds of lines: dozens of chunks written before the bad one
    result = translate_here(ckpt, capsys, f"input={src}", f"output={out}", "chunk_lines=8", "decoding=greedy")
    assert_one_line_error(result, str(src))
    assert out.read_text(encoding="utf-8") == OLD and sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]
    src.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")  # the same run on good input
    from nmt.cli_io import StopSignals
    from nmt.translate import translate_file

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("translate", overrides=[f"ckpt={ckpt}", "decoding=greedy", f"input={src}", f"output={out}"])
    with StopSignals() as signals:
        translate_file(cfg, signals)
    assert out.read_text(encoding="utf-8").count("\n") == len(LINES) and (out.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]


@pytest.mark.parametrize("where", ["under_a_file", "missing_folder"])
def test_an_unwritable_output_is_one_line_naming_output(ckpt, src, tmp_path, capsys, where):
    """As root every folder is writable: a path under a regular file, or in a missing folder."""
    if where == "under_a_file":
        output = src / "out.txt"
        result = translate(ckpt, tmp_path, f"input={src}", f"output={output}")
    else:
        output = tmp_path / "nowhere" / "out.txt"
        result = translate_here(ckpt, capsys, f"input={src}", f"output={output}")
    assert_one_line_error(result, f"output={output}: its folder {output.parent}")
    assert not output.parent.is_dir()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_full_disk_is_one_line_naming_output(ckpt, src, capsys):
    """/dev/full opens, and every write to it fails with ENOSPC."""
    assert_one_line_error(translate_here(ckpt, capsys, f"input={src}", "output=/dev/full"),
                          "output=/dev/full: No space left on device")


# --- signals and a closed pipe ------------------------------------------------------------------
def long_input(tmp_path: Path) -> Path:
    path = tmp_path / "long.txt"
    path.write_text("".join(line + "\n" for line in LINES * 100), encoding="utf-8")
    return path


def wait_for_lines(path: Path, proc: subprocess.Popen, lines: int, timeout: float = 600) -> None:  # a hang guard
    """Until the output being written (under its temporary name beside ``path``) has ``lines`` lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.read_bytes().count(b"\n") >= lines for p in path.parent.glob(f".{path.name}.*.tmp")):
            return
        assert proc.poll() is None, f"translate.py ended (status {proc.returncode}) before {lines} lines"
        time.sleep(0.05)
    raise TimeoutError(f"{path} has fewer than {lines} lines")


def own_translations(ckpt: Path, lines: list[str]) -> list[str]:
    """The model's translations of ``lines`` as translate.py decodes them (greedy, kernels=auto)."""
    loaded = load_checkpoint(ckpt)
    loaded.model.set_kernels("auto")
    search = search_of(SearchSettings.from_config(OmegaConf.load(CONF_DIR / "decoding" / "greedy.yaml")))
    return translate_lines(loaded.model, loaded.src_vocab, loaded.tgt_vocab, lines, search,
                           max_src_len=model_max_src_len(loaded.run_config))[0]


@pytest.mark.slow  # end to end in processes of its own: the slow tier
@pytest.mark.parametrize("signum, workers, inherited_ignored",
                         [(signal.SIGINT, 2, False), (signal.SIGINT, 2, True), (signal.SIGTERM, 1, False)],
                         ids=["SIGINT", "SIGINT-background", "SIGTERM"])
def test_a_signal_stops_the_run_with_whole_translated_lines_and_no_traceback(ckpt, tmp_path, signum, workers,
                                                                              inherited_ignored):
    """SIGINT-background: started as ``translate.py ... &`` by a shell without job control, which
    starts it with SIGINT ignored; ``kill -INT <pid>`` must stop it all the same."""
    src, out = long_input(tmp_path), tmp_path / "out.txt"
    ignore_sigint = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if inherited_ignored else None
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(command(ckpt, f"input={src}", f"output={out}", "chunk_lines=8", f"workers={workers}",
                                        "precision=32"),  # as own_translations decodes
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path,
                                preexec_fn=ignore_sigint)
        try:
            wait_for_lines(out, proc, 16)
            proc.send_signal(signum)
            status = proc.wait(timeout=600)
        finally:
            proc.kill()
    errors = (tmp_path / "stderr.txt").read_text()
    assert status == 128 + signum, errors[-3000:]
    assert "Traceback" not in errors and f"stopped by {signal.Signals(signum).name}" in errors
    text = out.read_text(encoding="utf-8")  # the lines written so far, put in place
    assert text.endswith("\n") and not list(tmp_path.glob(".out.txt.*.tmp"))
    written = text.split("\n")[:-1]
    assert 16 <= len(written) < len(LINES) * 100
    assert written == own_translations(ckpt, (LINES * 100)[: len(written)])


@pytest.mark.slow  # end to end in processes of its own: the slow tier
@pytest.mark.parametrize("workers", [1, 2])
def test_a_sigint_at_any_moment_of_a_background_run_stops_it(tmp_path, workers):
    """``translate.py ... &`` from a shell without job control (SIGINT inherited as ignored), the
    SIGINT sent at moments from the imports through Hydra, the model's load and the first lines:
    every run ends 130 with whole lines (one in the imports was lost: the run went on to its end)."""
    src, saved = long_input(tmp_path), ROOT / "tests" / "data" / "saved" / "lstm_luong.release.ckpt"
    for k, delay in enumerate((0.2, 0.8, 1.5, 3.0)):
        out = tmp_path / f"out{k}.txt"
        with open(tmp_path / "stderr.txt", "w") as stderr:
            proc = subprocess.Popen(command(saved, f"input={src}", f"output={out}", "chunk_lines=8", f"workers={workers}"),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
            try:
                time.sleep(delay)
                proc.send_signal(signal.SIGINT)
                status = proc.wait(timeout=600)
            finally:
                proc.kill()
        errors = (tmp_path / "stderr.txt").read_text()
        assert status == 130 and "Traceback" not in errors and "stopped by SIGINT" in errors, (delay, errors[-2000:])
        text = out.read_text(encoding="utf-8") if out.exists() else ""
        assert text == "" or text.endswith("\n")


@pytest.mark.slow  # end to end in a process of its own: the slow tier
def test_a_stop_while_the_input_is_awaited_ends_the_run_at_once(tmp_path):
    """A pipe that stays open with no line coming (``sleep 1000 | translate.py``): SIGTERM waited
    for the next line or the end of the input; now it stops the run while it waits."""
    saved = ROOT / "tests" / "data" / "saved" / "transformer.ckpt"
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(command(saved), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr,
                                cwd=tmp_path)
        try:
            proc.stdin.write(b"ein satz\n")
            proc.stdin.flush()
            deadline = time.monotonic() + 300
            while "loaded" not in (tmp_path / "stderr.txt").read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1)  # past the model's load: reading the input
            proc.send_signal(signal.SIGTERM)
            status = proc.wait(timeout=60)
        finally:
            proc.kill()
    errors = (tmp_path / "stderr.txt").read_text()
    assert status == 143 and "stopped by SIGTERM" in errors and "Traceback" not in errors, errors[-2000:]


def test_a_stop_signal_is_never_lost_between_the_handlers():
    """Kept before ``StopSignals`` (``hold_stop_signals``): the block stops as it starts. Inside
    it, a first signal is recorded, never raised at an arbitrary moment (inside Python code that
    torch's C++ called back, that aborted the process), and stops the run at ``check()``, or as
    the block ends when no check comes; a second one stops at once."""
    from nmt import cli_io
    from nmt.cli_io import StopSignals, Stopped, hold_stop_signals

    def signalled(signum: int) -> None:
        os.kill(os.getpid(), signum)
        time.sleep(0.05)  # the handler runs

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        hold_stop_signals()
        signalled(signal.SIGTERM)
        with pytest.raises(Stopped) as stopped:
            with StopSignals():
                raise AssertionError("the block ran after a kept signal")
        assert stopped.value.signum == signal.SIGTERM and cli_io._held == []
        with pytest.raises(Stopped) as stopped:
            with StopSignals() as signals:
                signalled(signal.SIGINT)  # recorded, not raised here
                steps = "went on"
                signals.check()
        assert steps == "went on" and stopped.value.signum == signal.SIGINT
        with pytest.raises(Stopped):
            with StopSignals():
                signalled(signal.SIGINT)  # the run ends without another check(): the block's end stops it
        with pytest.raises(Stopped):
            with StopSignals():
                signalled(signal.SIGINT)
                signalled(signal.SIGTERM)
                raise AssertionError("a second signal did not stop at once")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        cli_io._held.clear()


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_a_closed_stdout_ends_the_run_quietly(ckpt, tmp_path):
    """``translate.py ... | head -3``: the reader goes away after three lines."""
    src = long_input(tmp_path)
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(command(ckpt, f"input={src}", "chunk_lines=8"), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=stderr, cwd=tmp_path)
        try:
            head = [proc.stdout.readline() for _ in range(3)]
            proc.stdout.close()
            status = proc.wait(timeout=600)
        finally:
            proc.kill()
    errors = (tmp_path / "stderr.txt").read_text()
    assert all(line.endswith(b"\n") for line in head)
    assert status == 128 + signal.SIGPIPE, errors[-3000:]
    assert "Traceback" not in errors and "BrokenPipe" not in errors and "Exception ignored" not in errors


# --- which errors are one line ------------------------------------------------------------------
def test_only_errors_raised_by_nmt_become_one_line(capsys):
    from nmt.cli_io import ending_cleanly
    from nmt.inference.translations import output_format

    with pytest.raises(SystemExit) as stop, ending_cleanly():
        output_format("xml", "translate", 1)
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: format=xml: choose auto or one of text, jsonl for translations\n"
    with pytest.raises(ValueError, match="a bug elsewhere"), ending_cleanly():
        raise ValueError("a bug elsewhere")  # raised in this file, not in nmt: keeps its traceback
    with pytest.raises(SystemExit) as stop, ending_cleanly():
        raise MemoryError  # wherever it comes from: the machine, not a bug
    assert stop.value.code == 2 and capsys.readouterr().err == (
        "error: out of memory; use smaller batches (max_tokens), shorter inputs or a machine with more memory\n")


@pytest.mark.slow  # translate.py end to end in a process of its own, with a writer: the slow tier
def test_a_named_pipe_as_input_loses_no_line(ckpt, tmp_path):
    """The path check must not open a named pipe (that would take the first writer's data): every
    line written into it is translated, as the same lines from a file are."""
    lines = [f"ko guka du pana {word}" for word in ("moba", "pu", "nu", "dope", "kukekos")]
    plain = tmp_path / "in.txt"
    plain.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    out, expected = tmp_path / "fifo.out", tmp_path / "file.out"
    process = subprocess.Popen(command(ckpt, f"input={fifo}", f"output={out}"), cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with open(fifo, "w", encoding="utf-8") as writer:  # blocks until the run opens it to read
        writer.write(plain.read_text(encoding="utf-8"))
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr
    status, stderr = translate(ckpt, tmp_path, f"input={plain}", f"output={expected}")
    assert status == 0, stderr
    assert out.read_text(encoding="utf-8") == expected.read_text(encoding="utf-8")
    assert len(out.read_text(encoding="utf-8").splitlines()) == len(lines)


STEP_THAT_HANGS = """
import sys, time
from nmt.cli_io import StopSignals, ending_cleanly
with ending_cleanly(), StopSignals(grace=0.5) as signals:
    if sys.argv[1] == "writing":
        signals.defer()  # output exists: no grace, the run ends at its next check
    print("reading", flush=True)
    for _ in range(25):  # a read that lets no check run: 2.5 s, Python code (a C++ call would be the same)
        time.sleep(0.1)
    print("read to the end", flush=True)
    signals.check()
"""


@pytest.mark.parametrize("phase", ["loading", "writing"])
def test_a_first_signal_during_a_long_load_ends_the_process_after_the_grace(tmp_path, phase):
    """Before any output exists a first SIGTERM that no check meets within the grace (a file
    that takes long to read or load, whatever it holds) ends the process then, status 143;
    once output exists (``defer``) the run ends at its next check, between whole lines."""
    proc = subprocess.Popen([sys.executable, "-c", STEP_THAT_HANGS, phase], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline() == "reading\n"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, errors = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 143 and "Traceback" not in errors, errors
    if phase == "loading":
        assert out == "" and took < 2.2  # 2.5 s of reading left: it did not wait for them
        assert errors.strip() == ("stopped by SIGTERM: the file being read or loaded did not let go within 0.5 s; "
                                  "nothing was written")
    else:
        assert out == "read to the end\n" and errors.strip() == "stopped by SIGTERM"


@pytest.mark.slow  # end to end in a process of its own: the slow tier
def test_translate_stops_within_the_grace_while_a_model_loads(tmp_path):
    """``translate.py`` with a model whose load does not end (stood in for by a load that
    sleeps): SIGTERM ends it within STOP_GRACE seconds, status 143, and no output file."""
    from nmt.cli_io import STOP_GRACE

    saved = ROOT / "tests" / "data" / "saved" / "transformer.ckpt"
    script = ("import sys, time, nmt.translate as t\n"
              "def hang(cfg):\n    print('loading', file=sys.stderr, flush=True)\n    time.sleep(600)\n"
              "t.open_translator = hang\nsys.argv = ['translate.py', *sys.argv[1:]]\nt.main()\n")
    out = tmp_path / "out.txt"
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", script, f"ckpt={saved}", f"output={out}"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 300
            while "loading" not in (tmp_path / "stderr.txt").read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            status = proc.wait(timeout=120)
            took = time.monotonic() - sent
        finally:
            proc.kill()
    errors = (tmp_path / "stderr.txt").read_text()
    assert status == 143 and "stopped by SIGTERM" in errors and "Traceback" not in errors, errors[-2000:]
    assert took < STOP_GRACE + 5 and not out.exists()

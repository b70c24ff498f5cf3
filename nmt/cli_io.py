"""What ``translate.py`` (both modes) reads, writes, and how it ends: the output is never one of
the inputs, it is opened only once everything before the first line is checked, and a run ends
without a traceback on a user's error, a signal or a closed pipe (``ending_cleanly`` ends every
Hydra command the same way, through ``hydra_command``).

- ``hydra_command``: a command's ``main``: the config resolvers, Hydra's composition of its
  config and command line, and its work run under ``ending_cleanly``.
- ``check_paths``: every input opens for reading, the output's folder exists, and the output is
  not an input (the same device and inode: through symlinks and hard links too, and stdin or
  stdout redirected from or to it); a one-line ``ValueError`` names the keys.
- ``OutputFile``: the output file, written under a temporary name beside it and renamed over it
  when the run ends (also when a signal stopped it, with the whole lines written so far); after an
  error an existing file is left as it was (a new one gets the lines finished before the error). A
  device or a named pipe is written in place.
- ``StopSignals``: SIGINT and SIGTERM stop the run at the next ``check()`` (between the command's
  steps; the writer calls it after each batch, when every line that can be written in order is),
  so the output holds only whole lines, or at once while the input is awaited. A second signal
  stops at once. Before any output exists, a first signal that no check meets within ``grace``
  seconds (a file that takes long to read or load, whatever it holds) ends the process then
  (``translate.py``: ``STOP_GRACE``). ``hold_stop_signals`` keeps one that comes before, from the script's first line.
- ``stop_within_grace``: the same for the file reads and model loads of every other command
  (``nmt-evaluate``, ``nmt-export``, ``nmt-average``, ``nmt-import``, ``nmt-prune``, ``nmt-serve``'s
  start, ``nmt-distill``'s teacher, ``train.py``'s ``init_from`` and resume): a first signal stops
  the command as the block ends, or ``STOP_GRACE`` seconds after it came; outside the block the
  command's own handling goes on (Python's, Lightning's, uvicorn's).
- ``write_failure``: the error for a write that failed (a full disk, a file-size limit), naming
  the file and what was kept; torch and SentencePiece report such failures as other errors.
- ``ending_cleanly``: exit statuses 128 + signal (130 SIGINT, 143 SIGTERM); 141 (128 + SIGPIPE,
  what a tool killed by SIGPIPE reports) and nothing on stderr when the reader of stdout went
  away (``| head``); 2 (``EXIT_ERROR``) and one line ``error: ...`` for a ``MemoryError``, and for a ``ValueError``
  or ``OSError`` raised in nmt's own code (``HYDRA_FULL_ERROR=1`` re-raises it, with its
  traceback). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import signal
import stat
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

PACKAGE = Path(__file__).resolve().parent
T = TypeVar("T")
EXIT_ERROR = 2  # a user's error (a bad key, value or file): one line on stderr, as for a misused command
FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})  # a write failed for want of space


def write_failure(path: str | Path, error: BaseException, kept: str) -> OSError:
    """The one-line error (``ending_cleanly`` shows it as ``error: <path>: ...``) for a write to
    ``path`` that failed with ``error``; ``kept`` says what is left as it was."""
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror
    else:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    code = error.errno if isinstance(error, OSError) and error.errno else errno.EIO
    hint = ": free some disk space or raise the file-size limit" if code in FULL or code == errno.EIO else ""
    return OSError(code, f"could not be written ({reason}){hint}; {kept}", str(path))


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _stat(path: str | None, fd: int) -> os.stat_result | None:
    """``path``'s status, or the status of the open file ``fd`` (stdin/stdout) when it is None."""
    try:
        return os.stat(path) if path is not None else os.fstat(fd)
    except (OSError, ValueError):
        return None


def check_output_folder(output: str) -> None:
    """Raise when ``output`` cannot be written: a folder, a file in a missing or unwritable folder."""
    folder = os.path.dirname(os.path.abspath(output))
    if os.path.isdir(output):
        raise ValueError(f"output={output}: is a folder; give a file name")
    if not os.path.isdir(folder):
        what = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
        raise ValueError(f"output={output}: its folder {folder} {what}; create the folder or write elsewhere")
    if not os.access(output if os.path.exists(output) else folder, os.W_OK):
        raise ValueError(f"output={output}: permission denied; write elsewhere")


def check_paths(inputs: Mapping[str, str | None], output: str | None) -> None:
    """Raise a one-line ``ValueError`` naming the key when an input (``{key: path}``, None: stdin)
    cannot be read, the output cannot be written, or the output is one of the inputs."""
    for key, path in inputs.items():
        if path is not None:
            try:
                if stat.S_ISDIR(os.stat(path).st_mode):
                    raise ValueError(f"{key}={path}: a folder, not a file")
                if stat.S_ISREG(os.stat(path).st_mode):
                    with open(path, "rb"):
                        pass
                elif not os.access(path, os.R_OK):  # a named pipe or a device: opening would take its data
                    raise PermissionError(13, "Permission denied")
            except OSError as e:
                raise ValueError(f"{key}={path}: {e.strerror or e}") from None
    if output is not None:
        check_output_folder(output)
    out = _stat(output, 1)
    if out is None or not stat.S_ISREG(out.st_mode):  # a new file, a terminal, a pipe, /dev/null
        return
    for key, path in inputs.items():
        st = _stat(path, 0)
        if st is not None and _same_file(st, out):
            where_out = f"output={output}" if output is not None else "stdout"
            where_in = f"{key}={path}" if path is not None else "stdin"
            raise ValueError(f"{where_out} is the same file as {where_in}: writing it would destroy the input; "
                             "write the output to another file")


def current_umask() -> int:
    """The process's file-creation mask: from /proc on Linux (no race with other threads), else
    read by setting it and setting it back at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class OutputFile:
    """``path`` written through ``stream``: a regular file (or a new one) under a temporary name in
    its folder, renamed over it by ``finish()`` with the mode an existing file had (a symbolic link
    is followed: its target is replaced); ``discard()`` removes the temporary file, so an error
    leaves an existing output as it was. A device or a named pipe is opened and written in place."""

    def __init__(self, path: str) -> None:
        self.path, self.tmp = path, None
        target = os.path.realpath(path)
        status = _stat(target, -1)
        self.existed = status is not None  # a file the run must not replace unless it succeeds
        try:
            if status is not None and not stat.S_ISREG(status.st_mode):
                self.stream: IO[str] = open(path, "w", encoding="utf-8")
                return
            fd, self.tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.",
                                            suffix=".tmp")
            os.fchmod(fd, stat.S_IMODE(status.st_mode) if status is not None else 0o666 & ~current_umask())
            self.stream = os.fdopen(fd, "w", encoding="utf-8")
            self.target = target
        except OSError as e:
            raise ValueError(f"output={path}: {e.strerror or e}") from None

    def finish(self) -> None:
        """Close the stream and put the file in place; an error (its last lines could not be
        written) names the output and leaves an existing file as it was."""
        try:
            self.stream.close()
            if self.tmp is not None:
                os.replace(self.tmp, self.target)
        except OSError as e:
            self.discard()
            raise OSError(e.errno, e.strerror, f"output={self.path}") from None

    def end_on_error(self) -> None:
        """After an error: the lines finished so far go in place of a new output; an existing one
        is left as it was."""
        if self.existed:
            return self.discard()
        try:
            self.finish()
        except OSError:
            pass

    def discard(self) -> None:
        try:
            self.stream.close()
        except OSError:
            pass
        if self.tmp is not None:
            Path(self.tmp).unlink(missing_ok=True)


class Stopped(BaseException):
    """SIGINT or SIGTERM stopped the run (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.note = ""  # what was written, for the message


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_GRACE = 3.0  # seconds a first signal waits for the next check before any output exists
_held: list[int] = []  # the stop signals received while only ``hold_stop_signals``'s handler was set


def _hold(signum: int, frame: object) -> None:
    _held.append(signum)


def hold_stop_signals(received: Iterable[int] = ()) -> None:
    """From here until ``StopSignals`` takes over, a SIGINT or SIGTERM is kept instead of lost: a
    command calls this first thing, before its imports, Hydra and the model (seconds in which a
    signal inherited as ignored, ``translate.py ... &`` from a shell without job control, was
    dropped); ``StopSignals`` stops at its start for a kept one, and ``stop_if_held`` at the end.
    ``received``: signals a handler of the caller's own kept before this module was imported."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, _hold)
    _held.extend(received)  # after: one arriving meanwhile went to the caller's list or to ours


def stop_if_held() -> None:
    """Exit 128 + signal for a stop signal kept by ``hold_stop_signals`` (one that came after the
    run's own handlers were gone)."""
    if _held:
        _say(f"stopped by {signal.Signals(_held[0]).name}")
        raise SystemExit(128 + _held[0])


class StopSignals:
    """SIGINT and SIGTERM handlers for the block (in the main thread): a first signal raises
    ``Stopped`` at the next ``check()`` (the command checks between its steps, the writer after
    each batch), or at once while the input is awaited (``waiting``); a second one at once. Never
    at an arbitrary moment: raised inside Python code that torch's C++ called back (a lazy
    import during the model's load), it aborted the process (pybind11: terminate, SIGABRT).

    They are installed even where the signal was inherited as ignored: a shell without job
    control starts its background commands with SIGINT ignored, and ``kill -INT <pid>`` (or a
    Ctrl-C reaching the script's process group) must still stop the run with its lines in place.
    No signal is lost: one kept by ``hold_stop_signals`` before the block stops it as it starts;
    every signal is recorded before anything is raised, so a ``Stopped`` that lands where it is
    swallowed (a finalizer, a library's ``except BaseException``) is raised again by the next
    ``check()``, by ``defer()``, or as the block ends."""

    def __init__(self, grace: float | None = None) -> None:
        self.pending: int | None = None
        self.deferred = True
        self.grace = grace
        self._previous: dict[int, object] = {}
        self._overdue_timer: threading.Timer | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            if _held:  # a signal during start-up: stop before any work
                self.pending = _held.pop(0)
                self._restore()
                raise Stopped(self.pending)
        return self

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous = {}

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._disarm()
        self._restore()
        if exc_type is None and self.pending is not None:  # a stop that was swallowed on its way out
            raise Stopped(self.pending)

    def _handle(self, signum: int, frame: object) -> None:
        first = self.pending is None
        if first:
            self.pending = signum
        if self.deferred and first:
            if self.grace is not None:
                self._overdue_timer = threading.Timer(self.grace, self._overdue, args=(signum,))
                self._overdue_timer.daemon = True
                self._overdue_timer.start()
            return
        raise Stopped(signum)

    def _overdue(self, signum: int) -> None:
        """The step under way outlived the grace after a first signal (a file that takes long to
        read or load, whatever it holds): end the process now, which loses nothing before any
        output exists (``defer`` ends the grace once it does)."""
        _say(f"stopped by {signal.Signals(signum).name}: the file being read or loaded did not let go within "
             f"{self.grace:g} s; nothing was written")
        os._exit(128 + signum)

    def _disarm(self) -> None:
        if self._overdue_timer is not None:
            self._overdue_timer.cancel()
            self._overdue_timer = None

    def waiting(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, a signal stopping the run at once while the next one is awaited: input that
        trickles in (or never comes: ``sleep 1000 | translate.py``) does not defer a stop, and
        every line read before it is written already or not begun."""
        items = iter(items)
        while True:
            self.check()
            deferred, self.deferred = self.deferred, False
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                self.deferred = deferred
            yield item

    def defer(self) -> None:
        """A first signal stops the run only at ``check()`` (as from the start), with no grace:
        from here on output exists, and a run ends between whole lines."""
        self.deferred = True
        self.grace = None
        self._disarm()

    def check(self) -> None:
        if self.pending is not None:
            self._disarm()
            raise Stopped(self.pending)


@contextmanager
def stop_within_grace(grace: float = STOP_GRACE) -> Iterator[StopSignals]:
    """A command's reads and loads before its output exists, under ``StopSignals``: a first SIGINT or
    SIGTERM stops it as the block ends (``Stopped``: ``ending_cleanly`` says "stopped by SIGTERM;
    nothing was written", status 143), or ``grace`` seconds after it came if the block is still
    under way (a file that takes long to read or load, whatever it holds: ``StopSignals._overdue``);
    a second signal at once. Never at an arbitrary moment inside the load (see ``StopSignals``)."""
    with StopSignals(grace=grace) as signals:
        try:
            yield signals
            signals.check()
        except Stopped as stop:
            stop.note = stop.note or "; nothing was written"
            raise


def raised_in_nmt(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is nmt's code (not torch's, say)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(PACKAGE)


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except OSError:
        pass


def configured(build: Callable[[], T]) -> T:
    """``build()`` (a Hydra ``instantiate``), a config value it finds missing (``???``) turned into a
    one-line ValueError naming the key."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        return build()
    except MissingMandatoryValue as e:
        key = getattr(e, "full_key", None) or str(e).splitlines()[0]
        raise ValueError(f"{key}: no value (???); set it, e.g. {key}=<value>") from None


@contextmanager
def ending_cleanly() -> Iterator[None]:
    """Turn a signal, a closed stdout or a user's error in the block into an exit status (above)."""
    try:
        yield
    except Stopped as stop:
        _say(f"stopped by {signal.Signals(stop.signum).name}{stop.note}")
        raise SystemExit(128 + stop.signum) from None
    except KeyboardInterrupt:
        raise SystemExit(128 + signal.SIGINT) from None
    except BrokenPipeError:
        # The reader went away: later writes (the exit's flush of stdout) go nowhere, quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(128 + signal.SIGPIPE) from None
    except MemoryError:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _say("error: out of memory; use smaller batches (max_tokens), shorter inputs or a machine with more memory")
        raise SystemExit(EXIT_ERROR) from None
    except (ValueError, OSError) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or not raised_in_nmt(e):
            raise
        message = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else e
        _say(f"error: {message}")
        raise SystemExit(EXIT_ERROR) from None
    except Exception as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or (line := instantiation_error(e)) is None:
            raise
        _say(f"error: {line}")
        raise SystemExit(EXIT_ERROR) from None


def instantiation_error(error: BaseException) -> str | None:
    """``<config key>: <message>`` for Hydra's error building one of nmt's classes from a config
    whose value it refused in one line (a ValueError raised in nmt's code, e.g. ``num_heads=0``),
    else None (a bug keeps its traceback)."""
    cause = error.__cause__
    if type(error).__name__ != "InstantiationException" or not isinstance(cause, ValueError) or not (
            raised_in_nmt(cause) or "Error in call to target 'nmt." in str(error)):  # nmt's class, torch's check
        return None
    key = re.search(r"full_key: (\S+)", str(error))
    text = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    if key is None:
        return text
    return f"{key.group(1)}.{text}" if re.match(r"\w+=", text) else f"{key.group(1)}: {text}"


def hydra_command(config_name: str, work: Callable[[Any], Any],
                  set_up: Callable[[Any], None] | None = None) -> Callable[[], None]:
    """A command's ``main``: the config resolvers registered, then Hydra composes
    ``nmt/conf/<config_name>.yaml`` with the command line (overrides, ``--help``, ``--cfg``,
    ``-m``) and runs ``work(cfg)`` under ``ending_cleanly`` (a user's error: one line, status 2).
    ``set_up(cfg)``, a run's process-wide settings, comes first, outside it. Hydra names the job
    (its log file, its ``--help``) after ``work``'s module, and what ``work`` returns is the job's
    value (the metric a sweeper optimizes). Hydra is imported when ``main`` runs, not before."""

    def main() -> None:
        import hydra

        from nmt import CONF_DIR, register_resolvers

        @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")
        @functools.wraps(work)  # Hydra reads the job's name through __wrapped__: work's module
        def run(cfg: Any) -> Any:
            if set_up is not None:
                set_up(cfg)
            with ending_cleanly():
                return work(cfg)

        register_resolvers()
        run()

    return main

"""The output folder of an export: refused when it exists and is not empty, built under a
temporary name beside it and renamed into place when complete, so a failed export leaves nothing;
its folders and files get the modes the umask gives (whatever the writers inside chose)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nmt.cli_io import FULL, current_umask, write_failure


def check_free(out_dir: Path) -> None:
    """FileExistsError unless ``out_dir`` is absent or an empty folder (not a symbolic link, even
    one to an empty folder or to nothing: the finished folder could not be renamed over it)."""
    if out_dir.is_symlink():
        target = out_dir.readlink()
        what = "" if out_dir.exists() else ", which does not exist"
        raise FileExistsError(f"{out_dir} is a symbolic link to {target}{what}: give the path of a new or empty "
                              "folder")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not empty: remove it or export elsewhere")


def follow_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes the umask gives a new folder and file
    (``mkdtemp`` makes the folder 0700, and some writers make their files 0600)."""
    umask = current_umask()
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextmanager
def new_folder(out_dir: Path) -> Iterator[Path]:
    """A temporary folder beside ``out_dir`` to fill; renamed to ``out_dir`` when the block ends
    without error, removed otherwise (a full disk: one line naming ``out_dir``)."""
    check_free(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield tmp
        follow_umask(tmp)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        tmp.rename(out_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno not in FULL:
            raise
        raise write_failure(out_dir, e, "nothing was written") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

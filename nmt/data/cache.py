"""The prepared-data folders under `<cache_dir>/prepared/`: list them, and delete those no run
will open again.

    python -m nmt.data.cache                                  # every folder, its size and state
    python -m nmt.data.cache prune=true                       # delete the stale and partial ones
    python -m nmt.data.cache prune=true unused_days=30        # ... and those unopened for 30 days
    python -m nmt.data.cache prune=true dry_run=true          # say what would go, delete nothing

A folder's key holds its source files' sizes and modification times (`nmt.data.prepare`), so
editing a corpus prepares a new folder and leaves the old one behind. States:

- `current`: every source file still has the size and time the folder was keyed on;
- `stale`: a source file changed or is gone, or the folder is of another format or unreadable:
  no run's key can match it again;
- `kept`: generated or hub data, whose key does not rest on files: deleted only when unused;
- `partial`: a `.tmp-*` folder of a preparation that was killed; deleted once nothing in it
  has changed for `partial_hours`, so a preparation running now is never touched.

Preparing or opening a folder marks it used (the manifest's modification time).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt.cli_io import hydra_command
from nmt.data.prepare import FORMAT, TMP_PREFIX

log = logging.getLogger(__name__)
DAY = 86400.0


@dataclass(frozen=True)
class Entry:
    folder: Path
    state: str  # current | stale | kept | partial
    reason: str  # why stale or partial; what the source is otherwise
    size: int  # bytes
    last_used: float  # seconds since the epoch: the manifest's mtime, or a partial folder's newest file


def _changed_file(files: dict[str, list[Any]]) -> str | None:
    """What makes a `files` source's key outdated: a file gone or changed, or None."""
    for plan in files.values():
        for path, size, mtime_ns in plan[1:]:  # plan: [reader, [path, size, mtime_ns], ...]
            try:
                st = os.stat(path)
            except OSError:
                return f"{path} is gone"
            if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
                return f"{path} changed since it was prepared"
    return None


def _describe(source: dict[str, Any]) -> str:
    if source.get("type") == "files":
        return "files: " + ", ".join(stamp[0] for stamp in source["files"].get("train", [])[1:])
    if source.get("type") == "hub":
        return f"hub: {source['hub']}"
    return source.get("type", "unknown source")


def entry_for(folder: Path) -> Entry:
    """The state of one folder under `<cache_dir>/prepared/`."""
    stats = [p.stat() for p in folder.rglob("*") if p.is_file()]
    size = sum(st.st_size for st in stats)
    if folder.name.startswith(TMP_PREFIX):
        newest = max((st.st_mtime for st in stats), default=folder.stat().st_mtime)
        return Entry(folder, "partial", "a preparation that did not finish", size, newest)
    manifest = folder / "manifest.json"
    try:
        key = json.loads(manifest.read_text())["key"]
        last_used = manifest.stat().st_mtime
    except (OSError, ValueError, KeyError) as e:
        return Entry(folder, "stale", f"no readable manifest.json ({type(e).__name__})", size, folder.stat().st_mtime)
    if key.get("format") != FORMAT:
        return Entry(folder, "stale", f"format {key.get('format')}, this version reads {FORMAT}", size, last_used)
    source = key.get("source", {})
    if source.get("type") == "files":
        changed = _changed_file(source["files"])
        if changed:
            return Entry(folder, "stale", changed, size, last_used)
        return Entry(folder, "current", _describe(source), size, last_used)
    return Entry(folder, "kept", _describe(source), size, last_used)


def entries(cache_dir: Path) -> list[Entry]:
    prepared = Path(cache_dir) / "prepared"
    if not prepared.is_dir():
        return []
    return [entry_for(p) for p in sorted(prepared.iterdir()) if p.is_dir()]


def to_delete(found: list[Entry], unused_days: float | None = None, partial_hours: float = 24.0) -> list[Entry]:
    """The entries `prune` removes: stale ones, partial ones untouched for `partial_hours`, and
    with `unused_days` any folder not used for that long."""
    now = time.time()
    gone = []
    for entry in found:
        idle = now - entry.last_used
        if (entry.state == "stale" or (entry.state == "partial" and idle > partial_hours * 3600)
                or (unused_days is not None and entry.state != "partial" and idle > unused_days * DAY)):
            gone.append(entry)
    return gone


def _mb(size: int) -> str:
    return f"{size / 2**20:,.1f} MB"


def table(found: list[Entry]) -> str:
    now = time.time()
    lines = ["| folder | state | size | last used | source, or why |", "|---|---|---:|---|---|"]
    for e in found:
        used = datetime.datetime.fromtimestamp(e.last_used).strftime("%Y-%m-%d %H:%M")
        lines.append(f"| {e.folder.name} | {e.state} | {_mb(e.size)} | {used} ({(now - e.last_used) / DAY:.0f} days ago) | {e.reason} |")
    return "\n".join(lines)


def prune(cache_dir: Path, unused_days: float | None = None, partial_hours: float = 24.0,
          dry_run: bool = False) -> list[Entry]:
    """Delete (unless `dry_run`) what `to_delete` picks; returns those entries."""
    gone = to_delete(entries(cache_dir), unused_days, partial_hours)
    for entry in gone:
        log.info("%s %s (%s, %s: %s)", "would delete" if dry_run else "deleting", entry.folder, _mb(entry.size),
                 entry.state, entry.reason)
        if not dry_run:
            shutil.rmtree(entry.folder)
    return gone


def show_cache(cfg: Any) -> None:
    """List the prepared-data folders of ``cfg.paths.cache_dir``; with ``cfg.prune``, delete the unused ones."""
    cache_dir = Path(cfg.paths.cache_dir)
    found = entries(cache_dir)
    if not found:
        log.info("no prepared data under %s", cache_dir / "prepared")
        return
    log.info("prepared data under %s, %s in all:\n%s", cache_dir / "prepared", _mb(sum(e.size for e in found)),
             table(found))
    if cfg.prune:
        gone = prune(cache_dir, cfg.unused_days, cfg.partial_hours, cfg.dry_run)
        log.info("%s %d folder%s, %s", "would delete" if cfg.dry_run else "deleted", len(gone),
                 "" if len(gone) == 1 else "s", _mb(sum(e.size for e in gone)))


main = hydra_command("cache", show_cache)  # python -m nmt.data.cache: nmt/conf/cache.yaml


if __name__ == "__main__":
    main()

"""Re-run documented results and print each beside its documented figure, with the drift.

    python scripts/reproduce_results.py --list                      # the registry
    python scripts/reproduce_results.py                             # the cheap entries (cheap: true)
    python scripts/reproduce_results.py --only first_run_lstm multi30k_transformer
    python scripts/reproduce_results.py --all --dry-run             # the commands, without running them
    python scripts/reproduce_results.py --collect --out outputs/reproduce_results   # tabulate finished runs again
    python scripts/reproduce_results.py --check-docs                # the registry against the documents

The registry (``scripts/documented_results.yaml``, or ``--registry FILE``) names, for each
documented result, the command that produced it, where it is documented, and the metrics to read
back from its run folder with their documented values and tolerances. Each command runs from the
repository root with its files sent to ``<out>/<name>/`` (``hydra.run.dir=<out>/<name>`` unless the
entry names another ``output``), its log in ``<out>/<name>.log``, timed from start to exit
(``wall_seconds.json``). An entry that ``needs`` another's run (a teacher) brings it along unless
``<out>`` already holds that run finished, so entries can be re-run one at a time. The table
(name | command | metric | documented | measured | drift) is printed and written to
``<out>/reproduce_results.md`` and ``.json`` (``--json`` elsewhere). A row whose drift is outside
its tolerance is marked ``OUTSIDE``; the exit status is 1 if any row is, or a run failed, or a
metric could not be read. A metric that depends on the CPU (``per_cpu``: wall time, throughput)
is judged only on the CPU the entry names (``cpu``); measured on another one it is shown as
``other CPU``, with the CPU, and not judged.

``--check-docs`` reads every documented value back from its document: the cell of the entry's
table row in the metric's column (the first table under the named heading that has both), or, for
a figure in prose, the metric's ``quote``, which must appear in the file and start with the value.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

from nmt.machine import cpu_name
from nmt.runs.files import WALL, read, run_timed, value_at

REGISTRY = Path(__file__).with_name("documented_results.yaml")
ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OTHER_CPU = "other CPU"  # the status of a per_cpu metric measured on another CPU than documented: shown, not judged


ENTRY_FIELDS = {"name", "command", "output", "documented", "cost_minutes", "precision", "cpu", "cheap", "needs",
                "tolerance", "metrics"}
METRIC_FIELDS = {"metric", "file", "key", "documented", "tolerance", "scale", "column", "row", "section", "quote", "per_cpu"}
DOCUMENTED_FIELDS = {"file", "section", "row"}


def load_registry(path: Path) -> list[dict]:
    """The entries of a registry file, each name once, with only the fields above; a metric has a
    name, a file and a key (a list whose ``{field: value}`` parts pick by one field); a ``per_cpu``
    metric's entry names its ``cpu``."""
    entries = yaml.safe_load(path.read_text())["results"]
    names = [e["name"] for e in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SystemExit(f"{path}: names given twice: {', '.join(duplicates)}")
    for entry in entries:
        problems = [f"unknown field {k!r}" for k in entry if k not in ENTRY_FIELDS]
        problems += [f"documented: unknown field {k!r}" for k in entry.get("documented", {}) if k not in DOCUMENTED_FIELDS]
        for metric in entry.get("metrics", []):
            name = metric.get("metric", "a metric without a name")
            problems += [f"{name}: unknown field {k!r}" for k in metric if k not in METRIC_FIELDS]
            problems += [f"{name}: no {k!r}" for k in ("metric", "file", "key") if k not in metric]
            if not isinstance(metric.get("key", []), list):
                problems.append(f"{name}: the key must be a list")
                continue
            problems += [f"{name}: the key part {part} picks by {len(part)} fields, not one"
                         for part in metric.get("key", []) if isinstance(part, dict) and len(part) != 1]
            if metric.get("per_cpu") and not entry.get("cpu"):
                problems.append(f"{name}: per_cpu, but the entry names no cpu")
        if problems:
            raise SystemExit(f"{path}: {entry['name']}: {'; '.join(problems)}")
    return entries


def command_line(entry: dict, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The entry's command as arguments and environment: leading ``NAME=value`` words become
    environment variables, ``python`` this Python, ``{out}`` the folder of every entry's run folder
    (a command that reads another entry's run: ``needs``), and the ``output`` words (default
    ``hydra.run.dir={run_dir}``) are appended."""
    words = shlex.split(entry["command"].replace("{out}", shlex.quote(str(run_dir.parent))))
    env = dict(os.environ)
    while words and ENV_WORD.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    words = [sys.executable if w == "python" else os.path.expandvars(w) for w in words]  # $NMT_DATA_DIR
    output = entry.get("output", "hydra.run.dir={run_dir}").format(run_dir=shlex.quote(str(run_dir)))
    return words + shlex.split(output), env


def parse_number(text: str) -> float | None:
    """The first number in a table cell or quote: ``9:05`` -> 545 (minutes:seconds),
    ``**36.5** [35.0, 38.0]`` -> 36.5, ``2,662`` -> 2662, ``0.74x`` -> 0.74; None if there is none."""
    clock = re.fullmatch(r"\s*(\d+):(\d\d)\s*", text)
    if clock:
        return int(clock[1]) * 60 + int(clock[2])
    number = re.search(r"-?\d[\d,]*(?:\.\d+)?", text)
    return float(number[0].replace(",", "")) if number else None


def markdown_tables(path: Path) -> list[tuple[str | None, int, list[list[str]]]]:
    """The markdown tables of a file, each as (the heading above it, the line number of its first
    row, its rows as stripped cells: header, separator, body); lines in code blocks are neither."""
    tables, heading, table, start, in_code = [], None, [], 0, False
    for number, line in enumerate([*path.read_text(encoding="utf-8").splitlines(), ""], 1):
        if line.startswith("```"):
            in_code = not in_code  # a "#" in a code block is no heading
        if line.startswith("|") and not in_code:
            start = start if table else number
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if table:
            tables.append((heading, start, table))
        table = []
        if line.startswith("#") and not in_code:
            heading = line.lstrip("#").strip()
    return tables


def table_cell(path: Path, section: str, row: str, column: str) -> str:
    """The cell in ``column`` of the row with a cell ``row`` (exactly, after stripping), in the
    first markdown table under the heading ``section`` that has both. KeyError if none has."""
    for heading, _, table in markdown_tables(path):
        if heading == section and column in table[0]:
            index = table[0].index(column)
            for cells in table[2:]:
                if row in cells:
                    return cells[index]
    raise KeyError(f"{path}: no table under '# {section}' with a column '{column}' and a row '{row}'")


def check_docs(entries: list[dict]) -> list[str]:
    """One line per documented value that its document does not say (any more)."""
    problems = []
    for entry in entries:
        doc = entry["documented"]
        path = ROOT / doc["file"]
        text = " ".join(path.read_text(encoding="utf-8").split())
        for metric in entry["metrics"]:
            where = f"{entry['name']} / {metric['metric']}"
            if "quote" in metric:
                quote = " ".join(metric["quote"].split())
                if quote not in text:
                    problems.append(f"{where}: {doc['file']} no longer says '{quote}'")
                elif parse_number(quote) != metric["documented"]:
                    problems.append(f"{where}: '{quote}' is not {metric['documented']}")
                continue
            try:
                cell = table_cell(path, metric.get("section", doc["section"]), metric.get("row", doc.get("row")), metric["column"])
            except KeyError as error:
                problems.append(f"{where}: {error.args[0]}")
                continue
            if parse_number(cell) != metric["documented"]:
                problems.append(f"{where}: {doc['file']} says '{cell}', the registry {metric['documented']}")
    return problems


def measure(entry: dict, run_dir: Path) -> list[dict]:
    """One row per metric of the entry: documented and measured value, drift, tolerance, status."""
    rows = []
    ran_on, ran_in = run_cpu(run_dir), run_precision(run_dir)
    for metric in entry["metrics"]:
        documented = metric["documented"]
        tolerance = metric.get("tolerance", entry.get("tolerance"))
        row = {"name": entry["name"], "command": entry["command"], "metric": metric["metric"],
               "documented": documented, "measured": None, "drift": None, "tolerance": tolerance}
        try:
            measured = float(value_at(read(run_dir, metric["file"]), metric["key"])) * metric.get("scale", 1)
        except OSError:
            row["status"] = f"missing: {metric['file']}"
            rows.append(row)
            continue
        except (KeyError, IndexError, TypeError, ValueError) as error:
            row["status"] = f"missing: {metric['file']} {error}"
            rows.append(row)
            continue
        drift = measured - documented
        row.update(measured=measured, drift=drift)
        row["status"] = "OUTSIDE" if tolerance is not None and abs(drift) > tolerance else "ok"
        if metric.get("per_cpu") and entry.get("cpu") and ran_on and ran_on != entry["cpu"]:
            row["status"], row["judged"] = f"{OTHER_CPU} ({ran_on}; documented on {entry['cpu']})", False
        if entry.get("precision") and ran_in and ran_in != entry["precision"]:
            row["status"] += f" (measured in {ran_in}, documented in {entry['precision']})"
            row["judged"] = True
        rows.append(row)
    return rows


def run_cpu(run_dir: Path) -> str | None:
    """The CPU a run was measured on: ``wall_seconds.json``'s, else the first summary.json's or
    benchmark.json's under ``run_dir``; None if none says."""
    for path in [run_dir / WALL, *sorted(run_dir.rglob("summary.json")), *sorted(run_dir.rglob("benchmark.json"))]:
        try:
            data = json.loads(path.read_text())
            cpu = data.get("cpu") or data.get("hardware", {}).get("cpu")
        except (OSError, ValueError, AttributeError):
            continue
        if cpu:
            return " ".join(str(cpu).replace("|", "/").split())  # one table cell
    return None


def run_precision(run_dir: Path) -> str | None:
    """The trainer precision of the first training run under ``run_dir`` (its summary.json)."""
    for path in sorted(run_dir.rglob("summary.json")):
        try:
            return str(json.loads(path.read_text())["hardware"]["precision"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def number(value: float | None, signed: bool = False) -> str:
    """``value`` as the table shows it: up to 3 decimals, thousands separated; ``-`` for none."""
    if value is None:
        return "-"
    text = (f"{value:+,.3f}" if signed else f"{value:,.3f}").rstrip("0").rstrip(".")
    return "0" if text in ("+0", "-0") else text


def table(rows: list[dict]) -> str:
    """The markdown table of the measured rows."""
    lines = ["| name | command | metric | documented | measured | drift | tolerance | status |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | `{r['command']}` | {r['metric']} | {number(r['documented'])} | "
                     f"{number(r['measured'])} | {number(r['drift'], signed=True)} | {number(r['tolerance'])} | {r['status']} |")
    return "\n".join(lines) + "\n"


def listing(entries: list[dict]) -> str:
    """The registry as a markdown table."""
    lines = ["| name | cheap | minutes | command | documented in | metrics (documented) |", "|---|---|---:|---|---|---|"]
    for e in entries:
        doc = e["documented"]
        metrics = "; ".join(f"{m['metric']} {number(m['documented'])}" for m in e["metrics"])
        lines.append(f"| {e['name']} | {'yes' if e.get('cheap') else ''} | {e['cost_minutes']} | `{e['command']}` | "
                     f"{doc['file']}, {doc['section']} | {metrics} |")
    return "\n".join(lines) + "\n"


def select(entries: list[dict], only: list[str] | None, everything: bool, finished: set[str] = frozenset()) -> list[dict]:
    """The entries named by --only, or all with --all, else the cheap ones; with each, in registry
    order, the entries it ``needs`` (whose run it reads, e.g. a teacher) that are not ``finished``
    (a run folder under --out that holds a completed run is read, not run again)."""
    if only:
        known = {e["name"] for e in entries}
        unknown = [n for n in only if n not in known]
        if unknown:
            raise SystemExit(f"not in the registry: {', '.join(unknown)} (--list shows it)")
        names = set(only)
    else:
        names = {e["name"] for e in entries if everything or e.get("cheap")}
    by_name = {e["name"]: e for e in entries}
    pending = list(names)
    while pending:
        for need in by_name[pending.pop()].get("needs", []):
            if need not in names and need not in finished:
                names.add(need)
                pending.append(need)
    return [e for e in entries if e["name"] in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registry", type=Path, default=REGISTRY)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "reproduce_results", help="run folders: <out>/<name>")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these entries (default: the cheap ones)")
    parser.add_argument("--all", action="store_true", help="every entry")
    parser.add_argument("--list", action="store_true", help="show the registry and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    parser.add_argument("--collect", action="store_true", help="run nothing: read the finished runs under --out")
    parser.add_argument("--check-docs", action="store_true", help="compare the documented values with the documents")
    parser.add_argument("--json", type=Path, help="the table as JSON here (default <out>/reproduce_results.json)")
    args = parser.parse_args()
    entries = load_registry(args.registry)
    if args.list:
        print(listing(entries), end="")
        return
    if args.check_docs:
        problems = check_docs(entries)
        print("\n".join(problems) if problems else f"{len(entries)} entries: every documented value is in its document")
        raise SystemExit(1 if problems else 0)
    out = args.out.resolve()
    finished = {e["name"] for e in entries if (out / e["name"] / WALL).is_file()}
    chosen = select(entries, args.only, args.all, set() if args.collect else finished)
    if args.dry_run:
        for entry in chosen:
            words, env = command_line(entry, out / entry["name"])
            prefix = " ".join(f"{k}={v}" for k, v in env.items() if os.environ.get(k) != v)
            print(f"# {entry['name']} (~{entry['cost_minutes']} min)\n{prefix + ' ' if prefix else ''}{shlex.join(words)}")
        return
    rows, failed = [], []
    for entry in chosen:
        run_dir, log = out / entry["name"], out / f"{entry['name']}.log"
        if not args.collect:
            words, env = command_line(entry, run_dir)
            print(f"{entry['name']}: {entry['command']} (~{entry['cost_minutes']} min)", flush=True)
            try:
                seconds = run_timed(words, run_dir, log, entry["command"], cwd=ROOT, env=env, facts={"cpu": cpu_name()})
                print(f"{entry['name']}: {seconds:.0f} s", flush=True)
            except subprocess.CalledProcessError as error:
                failed.append(entry["name"])
                print(f"{entry['name']}: failed with status {error.returncode}; log: {log}", flush=True)
        rows += measure(entry, run_dir)
    md = table(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reproduce_results.md").write_text(md)
    (args.json or out / "reproduce_results.json").write_text(json.dumps({"failed": failed, "rows": rows}, indent=2) + "\n")
    print(md, end="")
    raise SystemExit(1 if failed or any(r["status"] != "ok" and r.get("judged", True) for r in rows) else 0)


if __name__ == "__main__":
    main()

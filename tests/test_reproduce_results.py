"""scripts/reproduce_results.py: documented results re-run from a registry, each read back from its
run folder beside its documented value; the real registry's commands compose and its documented
values are what the documents say."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from tests.conftest import CONF_DIR, KERNELS, ROOT, TINY, compose_train

SCRIPT = ROOT / "scripts" / "reproduce_results.py"
spec = importlib.util.spec_from_file_location("reproduce_results", SCRIPT)
reproduce = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reproduce)


def run_script(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_an_entry_brings_the_entries_it_needs_and_reads_their_runs_under_out(tmp_path):
    entries = [{"name": "teacher", "command": "python train.py"},
               {"name": "student", "command": "python distill.py distill.teacher={out}/teacher/last.ckpt",
                "needs": ["teacher"], "cheap": True},
               {"name": "other", "command": "python train.py"}]
    assert [e["name"] for e in reproduce.select(entries, ["student"], False)] == ["teacher", "student"]
    assert [e["name"] for e in reproduce.select(entries, None, False)] == ["teacher", "student"]
    assert [e["name"] for e in reproduce.select(entries, ["other"], False)] == ["other"]
    words, _ = reproduce.command_line(entries[1], tmp_path / "out" / "student")
    assert f"distill.teacher={tmp_path / 'out'}/teacher/last.ckpt" in words


def test_a_need_whose_run_is_finished_under_out_is_read_not_run_again(tmp_path):
    entries = [{"name": "teacher", "command": "python train.py", "cost_minutes": 1},
               {"name": "student", "command": "python distill.py", "needs": ["teacher"], "cost_minutes": 1}]
    assert [e["name"] for e in reproduce.select(entries, ["student"], False, {"teacher"})] == ["student"]
    assert [e["name"] for e in reproduce.select(entries, ["teacher", "student"], False, {"teacher"})] == [
        "teacher", "student"]  # named: run again
    out = tmp_path / "out"
    (out / "teacher").mkdir(parents=True)
    (out / "teacher" / "wall_seconds.json").write_text('{"command": "python train.py", "wall_seconds": 1}')
    registry = tmp_path / "registry.yaml"
    registry.write_text(yaml.safe_dump({"results": entries}))
    listed = run_script("--registry", str(registry), "--out", str(out), "--only", "student", "--dry-run")
    assert listed.stdout.count("# ") == 1 and "# student" in listed.stdout, listed.stdout + listed.stderr


@pytest.mark.slow  # the registry's runner end to end, in processes of its own: the slow tier
def test_a_tiny_entry_runs_and_its_metrics_are_read_back_beside_the_documented_values(tmp_path):
    overrides = [o for o in TINY if not o.startswith(("model.", "trainer.max_steps"))] + [
        "model.emb_size=16", "model.hidden_size=16", "trainer.max_steps=2", "test_decoding.beam_size=2",
        f"kernels={KERNELS[0]}", f"paths.cache_dir={tmp_path / 'cache'}"]
    entry = {
        "name": "tiny_transformer", "command": "python train.py model=transformer " + shlex.join(overrides),
        "documented": {"file": "README.md", "section": "First run", "row": "`transformer`"},
        "cost_minutes": 1, "cheap": True, "tolerance": 100,
        "metrics": [
            {"metric": "steps", "file": "summary.json", "key": ["steps"], "documented": 3, "tolerance": 0.5},
            {"metric": "test BLEU", "file": "bleu_by_length.json", "key": ["bleu"], "documented": 50},
            {"metric": "BLEU 1-10", "file": "bleu_by_length.json", "key": ["buckets", {"label": "1-10"}, "bleu"],
             "documented": 20, "tolerance": None},
        ],
    }
    registry = tmp_path / "registry.yaml"
    registry.write_text(yaml.safe_dump({"results": [entry]}))
    out = tmp_path / "out"
    result = run_script("--registry", str(registry), "--out", str(out))
    # the steps are 1 off the documented 3, outside their tolerance of 0.5: exit status 1
    assert result.returncode == 1, result.stdout + result.stderr
    run_dir = out / "tiny_transformer"
    summary = json.loads((run_dir / "summary.json").read_text())
    report = json.loads((run_dir / "bleu_by_length.json").read_text())
    timed = json.loads((run_dir / "wall_seconds.json").read_text())
    assert timed["command"] == entry["command"] and timed["cpu"] == summary["hardware"]["cpu"]
    rows = json.loads((out / "reproduce_results.json").read_text())["rows"]
    steps, bleu, short = rows
    assert summary["steps"] == 2
    assert (steps["measured"], steps["drift"], steps["status"]) == (2, -1, "OUTSIDE")
    assert bleu["measured"] == report["bleu"] and bleu["drift"] == report["bleu"] - 50 and bleu["status"] == "ok"
    first_bucket = report["buckets"][0]
    assert first_bucket["label"] == "1-10"
    assert short["measured"] == first_bucket["bleu"] and short["drift"] == first_bucket["bleu"] - 20
    assert short["status"] == "ok"  # no tolerance: the drift is shown, never marked
    table = (out / "reproduce_results.md").read_text()
    assert "| tiny_transformer | `python train.py model=transformer " in table
    assert "| steps | 3 | 2 | -1 | 0.5 | OUTSIDE |" in table
    assert table in result.stdout
    # --collect reads the same run folder again without running anything
    again = run_script("--registry", str(registry), "--out", str(out), "--collect", "--json", str(tmp_path / "again.json"))
    assert again.returncode == 1 and "tiny_transformer: python" not in again.stdout
    assert json.loads((tmp_path / "again.json").read_text())["rows"] == rows


def test_a_failed_run_and_a_missing_metric_are_reported(tmp_path):
    registry = tmp_path / "registry.yaml"
    registry.write_text(yaml.safe_dump({"results": [{
        "name": "broken", "command": "python -c 'raise SystemExit(3)'", "output": "",
        "documented": {"file": "README.md", "section": "First run"}, "cost_minutes": 0, "cheap": True,
        "metrics": [{"metric": "steps", "file": "summary.json", "key": ["steps"], "documented": 1}]}]}))
    result = run_script("--registry", str(registry), "--out", str(tmp_path / "out"), timeout=60)
    assert result.returncode == 1
    assert "broken: failed with status 3" in result.stdout
    (row,) = json.loads((tmp_path / "out" / "reproduce_results.json").read_text())["rows"]
    assert row["measured"] is None and row["status"].startswith("missing: summary.json")


def test_a_time_is_judged_only_on_the_cpu_it_was_documented_on(tmp_path):
    entry = {"name": "timed", "command": "python train.py", "cpu": "AMD EPYC (family 26, model 2)", "tolerance": 1,
             "metrics": [{"metric": "wall seconds", "file": "wall_seconds.json", "key": ["wall_seconds"],
                          "documented": 300, "tolerance": 60, "per_cpu": True},
                         {"metric": "steps", "file": "wall_seconds.json", "key": ["steps"], "documented": 10}]}

    def statuses(cpu: str, seconds: float, steps: int = 10) -> list[str]:
        (tmp_path / "wall_seconds.json").write_text(json.dumps({"wall_seconds": seconds, "steps": steps, "cpu": cpu}))
        return [row["status"] for row in reproduce.measure(entry, tmp_path)]

    assert statuses("AMD EPYC (family 26, model 2)", 443) == ["OUTSIDE", "ok"]
    assert statuses("AMD EPYC (family 26, model 2)", 320) == ["ok", "ok"]
    other = "other CPU (AMD EPYC (family 25, model 17); documented on AMD EPYC (family 26, model 2))"
    assert statuses("AMD EPYC (family 25, model 17)", 443) == [other, "ok"]
    assert statuses("AMD EPYC (family 25, model 17)", 443, steps=12) == [other, "OUTSIDE"]  # results are judged anywhere
    (tmp_path / "wall_seconds.json").write_text(json.dumps({"wall_seconds": 443, "steps": 10}))
    (tmp_path / "summary.json").write_text(json.dumps({"hardware": {"cpu": "AMD EPYC (family 25, model 17)"}}))
    assert [row["status"] for row in reproduce.measure(entry, tmp_path)] == [other, "ok"]  # an older run: its summary's CPU
    # another precision is judged, on any CPU
    (tmp_path / "summary.json").write_text(json.dumps({"hardware": {"cpu": "AMD EPYC (family 25, model 17)",
                                                                    "precision": "32-true"}}))
    rows = reproduce.measure({**entry, "precision": "bf16-mixed"}, tmp_path)
    assert rows[0]["status"] == other + " (measured in 32-true, documented in bf16-mixed)" and rows[0]["judged"]


def test_a_registry_field_or_key_that_would_be_misread_is_refused_naming_it(tmp_path):
    entry = {"name": "bench", "command": "python scripts/benchmark.py", "cost_minutes": 1, "cpu": "AMD EPYC",
             "documented": {"file": "README.md", "section": "First run"},
             "metrics": [{"metric": "lstm share", "file": "benchmark.json", "documented": 40, "per_cpu": True,
                          "key": ["models", {"model": "lstm", "per_cpu": True}, "train", "peak_fraction"]}]}
    registry = tmp_path / "registry.yaml"
    registry.write_text(yaml.safe_dump({"results": [entry]}))
    with pytest.raises(SystemExit, match=r"bench: lstm share: the key part \{'model': 'lstm', 'per_cpu': True\} "
                                         r"picks by 2 fields, not one$"):
        reproduce.load_registry(registry)
    entry["metrics"][0]["key"][1] = {"model": "lstm"}
    entry["metrics"][0]["tolerence"] = 5
    registry.write_text(yaml.safe_dump({"results": [entry]}))
    with pytest.raises(SystemExit, match=r"bench: lstm share: unknown field 'tolerence'$"):
        reproduce.load_registry(registry)
    del entry["metrics"][0]["tolerence"], entry["cpu"]
    registry.write_text(yaml.safe_dump({"results": [entry]}))
    with pytest.raises(SystemExit, match=r"bench: lstm share: per_cpu, but the entry names no cpu$"):
        reproduce.load_registry(registry)
    entry["cpu"] = "AMD EPYC (family 26, model 2)"
    entry["documented"]["per_cpu"] = True
    registry.write_text(yaml.safe_dump({"results": [entry]}))
    with pytest.raises(SystemExit, match=r"bench: documented: unknown field 'per_cpu'$"):
        reproduce.load_registry(registry)
    del entry["documented"]["per_cpu"]
    registry.write_text(yaml.safe_dump({"results": [entry]}))
    assert reproduce.load_registry(registry) == [entry]


def entries() -> list[dict]:
    return yaml.safe_load((ROOT / "scripts" / "documented_results.yaml").read_text())["results"]


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def training_overrides(script: str, args: list[str]) -> list[list[str]]:
    """The train.py overrides of every training run a command makes: train.py's own arguments, or
    for nmt-study (``python -m nmt.study``) each model's run in each stage (``--then`` replaces the keys it sets)."""
    if script == "train.py":
        return [args]
    experiment, models, then, overrides = "bleu_vs_length", ["lstm", "lstm_bahdanau", "lstm_luong", "transformer"], None, []
    words = iter(args)
    for word in words:
        if word == "--experiment":
            experiment = next(words)
        elif word == "--models":
            models = next(words).split(",")
        elif word == "--then":
            then = shlex.split(next(words))
        elif word in ("--out", "--heatmaps"):
            next(words)
        else:
            overrides.append(word)
    stages = [overrides]
    if then is not None:
        stages.append([o for o in overrides if override_key(o) not in {override_key(t) for t in then}] + then)
    return [[f"experiment={experiment}", f"model={model}", *stage] for model in models for stage in stages]


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_every_registered_command_composes_and_sends_its_files_to_its_run_folder(tmp_path):
    registered = entries()
    listed = run_script("--list", timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert all(f"| {e['name']} |" in listed.stdout for e in registered)
    dry = run_script("--all", "--dry-run", "--out", str(tmp_path / "out"), timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert sum(line.startswith("# ") for line in dry.stdout.splitlines()) == len(registered)
    assert not (tmp_path / "out").exists()  # a dry run runs and writes nothing
    composed = 0
    for entry in registered:
        run_dir = tmp_path / "out" / entry["name"]
        words, _ = reproduce.command_line(entry, run_dir)
        assert shlex.join(words) in dry.stdout
        assert str(run_dir) in " ".join(words)  # its files go to <out>/<name>
        script = words[2] if words[1] == "-m" else next(w for w in words if w.endswith(".py"))
        assert importlib.util.find_spec(script) if words[1] == "-m" else (ROOT / script).is_file(), script
        args = [w for w in words[words.index(script) + 1:] if not w.startswith("hydra.run.dir=")]
        if script in ("train.py", "nmt.study"):
            for overrides in training_overrides(script, args):
                compose_train(tmp_path, overrides, model=None)
                composed += 1
        elif script == "distill.py":
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                compose("distill", overrides=args)
            composed += 1
        elif script == "scripts/benchmark.py":
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=str(ROOT / "scripts" / "conf"), version_base="1.3"):
                compose("benchmark", overrides=[f"hydra.searchpath=[file://{CONF_DIR}]", *args])
            composed += 1
        else:  # an argparse script: it defines every option the command gives
            source = (ROOT / script).read_text()
            assert all(f'"{w}"' in source for w in args if w.startswith("--")), (script, args)
    GlobalHydra.instance().clear()
    assert composed >= 15


def test_the_registry_holds_what_the_documents_say(tmp_path):
    result = run_script("--check-docs", timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # a value the document does not say is named, with what the document says instead
    registry = tmp_path / "registry.yaml"
    first = entries()[0]
    first["metrics"][2]["documented"] = first["metrics"][2]["documented"] + 1
    registry.write_text(yaml.safe_dump({"results": [first]}))
    result = run_script("--registry", str(registry), "--check-docs", timeout=60)
    assert result.returncode == 1
    assert f"{first['name']} / {first['metrics'][2]['metric']}: README.md says" in result.stdout
    # a metric's own section wins over its entry's: the stage-1 row of the same model, not the stage-2 one
    europarl = next(e for e in entries() if e["name"] == "europarl_lstms")
    (stage1,) = [m for m in europarl["metrics"] if m["metric"] == "lstm stage 1 test BLEU"]
    assert stage1["section"] != europarl["documented"]["section"]
    stage1["documented"] += 1
    registry.write_text(yaml.safe_dump({"results": [europarl]}))
    result = run_script("--registry", str(registry), "--check-docs", timeout=60)
    assert result.returncode == 1
    assert result.stdout.strip() == (f"europarl_lstms / lstm stage 1 test BLEU: docs/studies/europarl.md says "
                                     f"'{stage1['documented'] - 1}', the registry {stage1['documented']}")

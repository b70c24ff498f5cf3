"""Precision follows the machine (``nmt.machine``): ``trainer.precision=auto`` and decoding's
``precision=auto`` pick bf16 only where the hardware computes it, no shipped config pins a
precision, and an explicit precision that this machine computes slowly is kept with a one-line
warning naming the measured factor and the faster choice. The hardware probes are replaced, so
every decision is tested on any CPU."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from nmt import machine
from nmt.machine import (auto_decoding_precision, auto_precision, cgroup_cpu_quota, cpu_has_bf16, cpu_has_vnni,
                         resolve_decoding_precision, resolve_precision, usable_cores)
from nmt.train import train
from tests.conftest import CONF_DIR, SEARCH_PATH


def cpu_with(monkeypatch, bf16: bool, vnni: bool, factor: float = 42.0) -> None:
    """This CPU, as the probes see it: bf16 and VNNI instructions or not; a matmul in a slow
    precision takes ``factor`` times its fp32 time."""
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: bf16)
    monkeypatch.setattr(machine, "cpu_has_vnni", lambda: vnni)
    monkeypatch.setattr(machine, "matmul_slowdown", lambda precision, **kwargs: factor)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("bf16, expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_auto_on_a_cpu_follows_its_bf16_instructions(cfg_train, monkeypatch, caplog, bf16, expected):
    cpu_with(monkeypatch, bf16=bf16, vnni=True)
    cfg = cfg_train(["trainer.precision=auto"])
    with caplog.at_level(logging.INFO, logger="nmt.machine"):
        resolve_precision(cfg)
    assert cfg.trainer.precision == expected
    assert f"trainer.precision=auto: {expected} (" in caplog.text


@pytest.mark.parametrize("bf16, expected", [(True, "bf16-mixed"), (False, "16-mixed")])
def test_auto_on_a_gpu_uses_bf16_or_loss_scaled_fp16(monkeypatch, bf16, expected):
    monkeypatch.setattr(machine, "gpu_has_bf16", lambda: bf16)
    assert auto_precision("cuda")[0] == expected


def test_an_explicit_precision_the_cpu_computes_is_kept_silently(cfg_train, monkeypatch, caplog):
    cpu_with(monkeypatch, bf16=True, vnni=True)
    for precision in ("32-true", "bf16-mixed"):
        cfg = cfg_train([f"trainer.precision={precision}"])
        with caplog.at_level(logging.WARNING, logger="nmt.machine"):
            resolve_precision(cfg)
        assert cfg.trainer.precision == precision
    assert caplog.records == []


def test_bf16_on_a_cpu_without_bf16_is_kept_with_a_one_line_warning(cfg_train, monkeypatch, caplog):
    """An AVX2-only CPU: bf16 matmuls are emulated (about 40x slower than fp32)."""
    cpu_with(monkeypatch, bf16=False, vnni=False, factor=42.0)
    cfg = cfg_train(["trainer.precision=bf16-mixed"])
    with caplog.at_level(logging.WARNING, logger="nmt.machine"):
        resolve_precision(cfg)
    assert cfg.trainer.precision == "bf16-mixed"
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.precision=bf16-mixed: a matmul takes 42.0x its fp32 time on this cpu; this cpu has no bf16 "
        "instructions (avx512_bf16/AMX), so bf16-mixed runs slowly; trainer.precision=auto is faster on this machine "
        "(it chooses 32-true)"]


NO_VNNI_SLOW = ("precision=int8: a matmul takes 12.5x its fp32 time on this cpu; this cpu has no int8 dot-product "
                "instructions (VNNI), so int8 runs slowly; precision=32 is faster on this machine")


@pytest.mark.parametrize("bf16, vnni, factor, requested, chosen, warned", [
    (True, True, 0.4, "auto", "bf16", None),
    (False, False, 0.4, "auto", "32", None),
    (True, True, 0.4, "int8", "int8", None),
    (False, False, 12.5, "int8", "int8", NO_VNNI_SLOW),
    (False, False, 0.6, "int8", "int8", None),  # no VNNI, and still faster than fp32 here: nothing to say
    (True, True, 3.0, "int8", "int8", "precision=int8: a matmul takes 3.0x its fp32 time on this cpu, so int8 runs "
                                      "slowly; precision=bf16 is faster on this machine"),
    (False, True, 12.5, "bf16", "bf16", "precision=bf16: a matmul takes 12.5x its fp32 time on this cpu; this cpu "
                                        "has no bf16 instructions (avx512_bf16/AMX), so bf16 runs slowly; precision=32 "
                                        "is faster on this machine"),
    (False, False, 12.5, "32", "32", None),
])
def test_decoding_precision_per_machine(monkeypatch, caplog, bf16, vnni, factor, requested, chosen, warned):
    cpu_with(monkeypatch, bf16=bf16, vnni=vnni, factor=factor)
    with caplog.at_level(logging.INFO, logger="nmt.machine"):
        assert resolve_decoding_precision(requested, "cpu") == chosen
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ([warned] if warned else [])
    if requested == "auto":
        assert f"precision=auto: {chosen} (" in caplog.text


def test_auto_decoding_never_picks_int8_and_picks_bf16_on_a_gpu_that_has_it(monkeypatch):
    monkeypatch.setattr(machine, "gpu_has_bf16", lambda: True)
    assert auto_decoding_precision("cuda")[0] == "bf16"
    monkeypatch.setattr(machine, "gpu_has_bf16", lambda: False)
    assert auto_decoding_precision("cuda")[0] == "32"


@pytest.mark.parametrize("cap, bf16, vnni", [(None, True, True), ("AVX2", False, False), ("avx2_vnni", False, True),
                                             ("AVX512_CORE", False, False), ("AVX512_CORE_VNNI", False, True),
                                             ("AVX512_CORE_BF16", True, True), ("ALL", True, True),
                                             ("no-such-level", True, True)])
def test_a_onednn_isa_cap_below_the_hardware_is_what_the_probes_see(monkeypatch, cap, bf16, vnni):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN compute as an AVX2-only CPU does: the probes agree."""
    for isa in ("avx512_bf16", "vnni", "amx_tile"):
        monkeypatch.setattr(torch.cpu, f"_is_{isa}_supported", lambda: True, raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert (cpu_has_bf16(), cpu_has_vnni()) == (bf16, vnni)


def test_the_probes_see_no_instruction_the_hardware_lacks(monkeypatch):
    for isa in ("avx512_bf16", "vnni", "amx_tile"):
        monkeypatch.setattr(torch.cpu, f"_is_{isa}_supported", lambda: False, raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert (cpu_has_bf16(), cpu_has_vnni()) == (False, False)


def test_the_slowdown_is_measured_on_this_cpu():
    """The factor a warning states comes from timing both matmuls here (fp32's own is 1 by
    definition; bf16 on any CPU and int8 give a positive finite factor)."""
    for precision in ("bf16-mixed", "int8"):
        factor = machine.matmul_slowdown(precision, rows=8, size=64, out=128, repeats=1)
        assert 0 < factor < float("inf")


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "200000 100000\n"}, 2),
    ({"cpu.max": "150000 100000\n"}, 2),   # 1.5 CPUs: a second thread still gets half a core
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_the_cgroup_quota_in_cores(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(tmp_path) == expected


def test_usable_cores_take_the_affinity_mask_within_the_quota(monkeypatch):
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(machine, "cgroup_cpu_quota", lambda: None)
    assert usable_cores() == 4
    monkeypatch.setattr(machine, "cgroup_cpu_quota", lambda: 2)
    assert usable_cores() == 2
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert usable_cores() == 1


def shipped_options() -> list[tuple[str, str]]:
    """(group, option) of every shipped config a user picks on the command line."""
    groups = ("model", "data", "experiment", "hparams_search", "trainer", "callbacks", "logger", "debug", "augment",
              "optimizer", "scheduler")
    return [(group, path.stem) for group in groups for path in sorted((CONF_DIR / group).glob("*.yaml"))]


@pytest.mark.slow  # every shipped option composed, about 60 configs: the slow tier
def test_no_shipped_config_pins_a_precision():
    """Every preset, data set, experiment, sweep, trainer, debug mode ... composed: the precision
    is still auto, so each machine decides (a pinned bf16 crawls on CPUs without bf16)."""
    GlobalHydra.instance().clear()
    pinned = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for group, option in shipped_options():
            cfg = compose("train", overrides=[SEARCH_PATH, f"{group}={option}"])
            if cfg.trainer.precision != "auto":
                pinned.append(f"{group}={option}: trainer.precision={cfg.trainer.precision}")
    GlobalHydra.instance().clear()
    assert len(shipped_options()) > 40
    assert pinned == []
    for name in ("translate", "serve", "evaluate"):
        text = (CONF_DIR / f"{name}.yaml").read_text()
        assert "\nprecision: auto " in text, name


def test_a_run_records_the_precision_auto_chose(cfg_train, tmp_path):
    cfg = cfg_train(["trainer.precision=auto", "test=false", "trainer.max_steps=2"])
    train(cfg)
    chosen = auto_precision("cpu")[0]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["hardware"]["precision"] == chosen
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["run_config"]["trainer"]["precision"] == chosen


def test_documented_results_record_their_precision():
    """Every documented training number names the precision it came from."""
    import yaml

    results = yaml.safe_load((Path(CONF_DIR).parents[1] / "scripts" / "documented_results.yaml").read_text())["results"]
    trained = [r for r in results if "train.py" in r["command"] or "nmt.study" in r["command"]]
    assert trained and all(r.get("precision") in ("32-true", "bf16-mixed") for r in trained), \
        [r["name"] for r in trained if r.get("precision") not in ("32-true", "bf16-mixed")]


def test_translate_warns_once_about_a_slow_int8_and_still_translates(serve_ckpt, monkeypatch, capsys, tmp_path):
    """translate.py precision=int8 where int8 is slow: one warning line on stderr naming the factor
    and the faster choice; the translations are the int8 model's, one line per input line."""
    from tests.conftest import translate_here

    cpu_with(monkeypatch, bf16=False, vnni=False, factor=12.5)
    src = tmp_path / "in.txt"
    src.write_text("a b c\n\nd e\n", encoding="utf-8")
    result = translate_here(capsys, f"ckpt={serve_ckpt}", f"input={src}", "precision=int8")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split("\n")) == 4 and result.stdout.split("\n")[1] == ""
    assert [line for line in result.stderr.splitlines() if "slow" in line] == [NO_VNNI_SLOW]

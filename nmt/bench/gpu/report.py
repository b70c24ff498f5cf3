"""The GPU check's report as markdown, from its JSON (``report``): a section per part, its status
when it did not end ok, its tables, and the time each part took against its budget."""

from __future__ import annotations

import math
from typing import Any


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def pct(x: float | None) -> str:
    return "–" if x is None or not finite(x) else f"{100 * x:.1f}%"


def _num(x: Any, spec: str = ",.0f") -> str:
    return format(x, spec) if finite(x) else "–"


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _tflops(x: Any) -> str:
    return format(x / 1e12, ".3g") if finite(x) else "–"


def _status(report: dict[str, Any], key: str) -> tuple[dict[str, Any], list[str]]:
    part = report["parts"].get(key)
    if part is None:
        return {}, ["Not run."]
    lines = [] if part["status"] == "ok" else [f"**{part['status']}**: {part.get('error', '')}", ""]
    return part.get("result", {}), lines


def _training_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | precision | variant | steps (batches) | target tok/s | tok/s (src+tgt) | ms per batch | model TFLOP/s "
             "| % of peak | target | peak MB | final loss | max_tokens | graphs compiled (s) | shapes an epoch |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        variant = r.get("variant", "eager")
        if "error" in r:
            lines.append(f"| {r['model']} | {r['precision']} | {variant} | {r['error']} |" + " |" * 11)
            continue
        target = (f"{pct(r['target_fraction'])}: {'met' if r['target_met'] else 'not met'}" if "target_fraction" in r else "")
        precision = r["precision"] + (f" (ran as {r['ran_as']})" if r.get("ran_as", r["precision"]) != r["precision"] else "")
        compiled = r.get("compile") or {}
        graphs = f"{compiled['graphs']} ({compiled['seconds']:.0f})" if compiled else ""
        shapes = compiled.get("batch_shapes_per_epoch") if compiled else None
        lines.append(f"| {r['model']} | {precision} | {variant} | {r['steps']} ({r['batches']}) | {_num(r['tgt_tokens_per_s'])} | "
                     f"{_num(r['tokens_per_s'])} | {_num(r['batch_ms'], '.1f')} | {_tflops(r['flops_per_s'])} | "
                     f"{pct(r['peak_fraction'])} | {target} | {_num(r['peak_mb'])} | {_num(r['final_loss'], '.3f')} | "
                     f"{_num(r.get('max_tokens'))} | {graphs} | {'' if shapes is None else shapes} |")
    notes = [f"- {r['model']} {r['precision']}: {r['note']}" for r in rows if r.get("note")]
    return lines + (["", *notes] if notes else []) + _speedups(rows)


def _speedups(rows: list[dict[str, Any]]) -> list[str]:
    """Target tokens/s of each variant against the same model's eager bf16 run."""
    eager = {r["model"]: r["tgt_tokens_per_s"] for r in rows
             if "error" not in r and r.get("variant", "eager") == "eager" and r["precision"] == "bf16-mixed"}
    ratios = [f"{r['model']} {r['variant']} {r['tgt_tokens_per_s'] / eager[r['model']]:.2f}x" for r in rows
              if "error" not in r and r.get("variant", "eager") != "eager" and eager.get(r["model"])]
    return ["", "Target tokens/s against eager bf16: " + ", ".join(ratios) + "."] if ratios else []


def markdown(report: dict[str, Any]) -> str:
    parts = report["parts"]
    lines = [f"# GPU check: {report['name']}" + (" (dry run, tiny sizes)" if report["dry_run"] else ""), "",
             f"`scripts/gpu_check.sh{' --dry-run' if report['dry_run'] else ''}`, started {report['started']}, "
             f"{report.get('elapsed_s', 0):.0f} s of the {report['deadline_s']} s deadline. "
             f"Every number is in the JSON file next to this one; `scripts/gpu_check.py` says how each is measured.", ""]
    if report["dry_run"]:
        lines += ["A dry run: the code of the GPU run on tiny models and data; its speeds and targets mean nothing."
                  + (" On a CPU the parity part compares the CPU kernels (`kernels=auto`) with the reference path."
                     if report["mode"]["device"] == "cpu" else ""), ""]

    lines += ["## 1. Environment", ""]
    result, head = _status(report, "env")
    lines += head
    if result:
        keys = ["device", "gpu", "gpu_memory_gb", "capability", "nvidia_smi", "torch", "cuda", "cudnn", "lightning", "python",
                "cpu", "cpu_count", "cpu_threads"]
        lines += ["| | |", "|---|---|", *[f"| {k} | {result[k]} |" for k in keys if k in result]]
        for dtype in ("bfloat16", "float16"):
            if f"matmul_peak_{dtype}" in result:
                lines.append(f"| matmul peak {dtype} ({result['matmul_size']}^3) | {_tflops(result[f'matmul_peak_{dtype}'])} TFLOP/s |")
    lines.append("")

    data, head = _status(report, "data")
    if data or head:
        lines += ["Data: " + (", ".join(f"{k} {v}" for k, v in data.items()) if data else " ".join(head)), ""]

    steps = report["mode"]["steps"]
    lines += ["## 2. Presets: eager and compiled", "",
              f"`nmt.train.train` with `trainer={'gpu' if report['mode']['device'] == 'cuda' else 'cpu'}`, {steps} optimizer "
              "steps (Lightning's `max_time` may stop it sooner), no "
              f"validation, test, logger or checkpoints; timed after the first {report['mode']['warmup']} batches, data "
              "loading included. Model FLOPs: `nmt.bench.flops.training_flops` on the timed batches' real tokens; "
              "% of the matmul peak of the same dtype. Variants: `eager` (`compile=false data.shapes=exact`, the path "
              "before the GPU levers), `compiled` (`compile=auto data.shapes=auto`: a GPU run's defaults), `cudagraphs` "
              "(`compile=cudagraphs`), `auto batch` (`data.max_tokens=auto`); a dry run traces (`compile=trace`).", ""]
    result, head = _status(report, "presets")
    lines += head + (_training_table(result["runs"]) if result.get("runs") else []) + [""]

    lines += ["## 3. transformer_base: eager, compiled and the automatic batch", "",
              "`experiment=transformer_base`: 6+6 layers, 512 wide, batches accumulated to ~25,000 tokens per optimizer step "
              "(`tokens_per_update`: 3 of 8,192 tokens, or as many of the batch `data.max_tokens=auto` finds)"
              + (" (a dry run shrinks the layers, width and batches)." if report["dry_run"] else "."), ""]
    result, head = _status(report, "base")
    lines += head + (_training_table(result["runs"]) if result.get("runs") else []) + [""]

    lines += ["## 4. Attention (SDPA) backends", ""]
    result, head = _status(report, "sdpa")
    lines += head
    if result.get("model_forward_backward"):
        names = list(result["model_forward_backward"])
        calls = result.get("sdpa_calls", {})
        kinds = [k for k in calls if k not in ("shape", "dtype")]
        lines += ["Each backend alone (`torch.nn.attention.sdpa_kernel`): the `transformer` preset's loss and backward "
                  f"under bf16 autocast, and SDPA alone at shape {calls.get('shape')} ({calls.get('dtype')}).", "",
                  "| backend | model forward/backward | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
        for name in names:
            lines.append(f"| {name} | {_short(result['model_forward_backward'][name])} | "
                         + " | ".join(_short(calls.get(k, {}).get(name, "")) for k in kinds) + " |")
        lines += ["", "One profiled training step, backends chosen by torch: "
                  + (", ".join(result.get("backends_ran", [])) or "no SDPA op seen") + "; its attention kernels:", ""]
        found = result.get("profiled_kernels") or {}
        lines += [f"- `{k}` x{v}" for k, v in found.items()] or ["- no device kernel matched"]
        lines += ["", "Attention ops: " + (", ".join(f"`{k}` x{v}" for k, v in result.get("profiled_ops", {}).items()) or "none")]
    lines.append("")

    lines += ["## 5. Gradient checkpointing", ""]
    result, head = _status(report, "checkpointing")
    lines += head
    if result.get("runs"):
        lines += ["The same weights and batches, `model.gradient_checkpointing` false then true, bf16 autocast, "
                  "Adam steps included.", "",
                  "| model | steps (tokens) | peak MB off | peak MB on | cut | saved for backward MB off | on | cut | ms per step off | on |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["runs"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['error']} |" + " |" * 8)
                continue
            lines.append(f"| {r['model']} | {r['steps']} ({r['tokens']:,}) | {_num(r['off']['peak_mb'])} | {_num(r['on']['peak_mb'])} | "
                         f"{pct(r['peak_cut'])} | {_num(r['off']['saved_mb'], ',.1f')} | {_num(r['on']['saved_mb'], ',.1f')} | "
                         f"{pct(r['saved_cut'])} | {_num(r['off']['step_ms'], '.1f')} | {_num(r['on']['step_ms'], '.1f')} |")
        lines += ["", f"Peak memory: {result['runs'][0].get('memory', '')}."]
        above = [f"{r['model']} {pct(r['peak_above_start_cut'])}" for r in result["runs"]
                 if r.get("peak_above_start_cut") is not None]
        if above:
            lines.append(f"Cut of the peak above the memory allocated before the steps (weights): {', '.join(above)}.")
    lines.append("")

    lines += ["## 6. Beam search: fixed shapes and CUDA graphs, the key/value cache, CTranslate2", ""]
    result, head = _status(report, "kv_cache")
    lines += head
    if result.get("runs"):
        lines += ["One batch of the test split's first sentences, bf16 autocast, output tokens/s (EOS included): "
                  "`decoding.engine=loop` (reads the device every step, shrinks the batch), `graphs` (fixed shapes, "
                  "one CUDA graph replayed per step, captured in the warm-up), the loop without the key/value cache "
                  "(the decoder re-runs the whole prefix at every step, `nmt.bench.decoding.NoCache`), and "
                  "CTranslate2 on the same weights exported by `nmt-export` (float16 on a GPU).", "",
                  "| model | weights | beam, batch | loop tok/s | graphs tok/s | graphs / loop | no cache tok/s "
                  "| cache factor (graphs / no cache) | target | CTranslate2 tok/s | ours / CTranslate2 | target "
                  "| outputs equal to the loop's |",
                  "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|---:|"]
        for r in result["runs"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['error']} |" + " |" * 11)
                continue
            e, ct2 = r["engines"], r.get("ctranslate2", {})
            against = (f"{r['against_ctranslate2']:.2f}x | >= {r['ct2_target']:g}x: {'met' if r['ct2_target_met'] else 'not met'}"
                       if "against_ctranslate2" in r else f"{_short(ct2.get('error', ''), 60)} | ")
            lines.append(f"| {r['model']} | {r['weights']} | {r['beam_size']}, {r['batch_size']} | "
                         f"{_num(e['loop']['tokens_per_s'])} | {_num(e['graphs']['tokens_per_s'])} | "
                         f"{r['graphs_over_loop']:.2f}x | {_num(e['no_cache']['tokens_per_s'])} | {r['speedup']:.2f}x | "
                         f">= {r['target']:g}x: {'met' if r['target_met'] else 'not met'} | "
                         f"{_num(ct2.get('tokens_per_s'))} | {against} | {pct(r['same_outputs_share'])} |")
        equal = [f"{r['model']}, all {r['fp32']['sentences']} (scores within {r['fp32']['max_score_rel_diff']:.2g})"
                 for r in result["runs"] if "fp32" in r]
        if equal:
            lines += ["", "In fp32 (TF32 off) `graphs` gave the loop's hypotheses, for a first search and for a replay of "
                      f"its capture (the part fails otherwise): {'; '.join(equal)}. The last column above is bf16's."]
        hosts = [r for r in result["runs"] if "error" not in r and "host" in r["engines"]["loop"]]
        if hosts:
            lines += ["", "The host's work per decoding step (one profiled search of the same batch): leaf aten "
                      "operators, CUDA launches (kernels, graph replays, copies) and reads of a value (each a wait "
                      "for the GPU).", "",
                      "| model | loop: operators / launches / reads per step | graphs: operators / launches / reads per step |",
                      "|---|---:|---:|"]
            for r in hosts:
                cells = [f"{h['ops_per_step']:.0f} / {h['launches_per_step']:.1f} / {h['reads_per_step']:.2f}"
                         for h in (r["engines"]["loop"]["host"], r["engines"]["graphs"]["host"])]
                lines.append(f"| {r['model']} | {cells[0]} | {cells[1]} |")
    lines.append("")

    lines += ["## 7. Loss parity", ""]
    result, head = _status(report, "parity")
    lines += head
    if result.get("runs"):
        tol = result["tolerance"]
        lines += [f"`module.loss` on one training batch ({result['batch']['sentences']} sentences), the same weights: "
                  f"`kernels=reference` on the CPU in fp32 against the device with `kernels=auto`; relative tolerance "
                  f"{tol['fp32']:g} in fp32 (TF32 off), {tol['bf16']:g} under bf16 autocast. "
                  f"All passed: {result.get('passed')}.", "",
                  "| model | CPU fp32 reference | device fp32 | rel. diff | pass | device bf16 | rel. diff | pass |",
                  "|---|---:|---:|---:|---|---:|---:|---|"]
        for r in result["runs"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['error']} |" + " |" * 6)
                continue
            lines.append(f"| {r['model']} | {r['cpu_fp32_reference']:.6f} | {r['fp32']['loss']:.6f} | {r['fp32']['rel_diff']:.2e} | "
                         f"{'pass' if r['fp32']['pass'] else 'FAIL'} | {r['bf16']['loss']:.6f} | {r['bf16']['rel_diff']:.2e} | "
                         f"{'pass' if r['bf16']['pass'] else 'FAIL'} |")
    lines.append("")

    lines += ["## 8. Attention patterns: cost against length", ""]
    result, head = _status(report, "attention")
    lines += head
    if result.get("summary"):
        lines += ["One sentence, one encoder layer (`nmt.bench.attention_cost`), bf16 autocast on a GPU; forward+backward.", "",
                  "| pattern | options | claimed | exponent (layer) | faster than full from n = | peak MB at 1,024 / 4,096 |",
                  "|---|---|---|---:|---:|---:|"]
        for variant, s in result["summary"].items():
            options = ", ".join(f"{k}={v}" for k, v in s["options"].items()) or "-"
            exp = "-" if s["exponent_layer"] is None else f"{s['exponent_layer']:.2f}"
            cross = "-" if s["crossover_layer"] is None else str(s["crossover_layer"])
            lines.append(f"| {variant} | {options} | {s['claimed']} | {exp} | {cross} | "
                         f"{_num(s.get('peak_mb_1024'))} / {_num(s.get('peak_mb_4096'))} |")
    lines.append("")

    lines += _claims(report)
    lines += ["## Timings", "", "| part | status | seconds | budget s |", "|---|---|---:|---:|"]
    for key, part in parts.items():
        lines.append(f"| {key} | {part['status']} | {part.get('seconds', '–')} | {part['budget_s']} |")
    return "\n".join(lines) + "\n"


def _rows(report: dict[str, Any], key: str) -> list[dict[str, Any]]:
    return [r for r in report["parts"].get(key, {}).get("result", {}).get("runs", []) if "error" not in r]


def _claims(report: dict[str, Any]) -> list[str]:
    """The seeds' GPU claims against this run's rows: the Transformer against the LSTMs in training
    speed, gradient checkpointing's memory and time, mixed precision's memory."""
    lines = ["## The seeds' claims", "", "| claim | measured here | from |", "|---|---|---|"]
    trained = {(r["model"], r["precision"], r.get("variant", "eager")): r for r in _rows(report, "presets")}
    for variant in ("eager", "compiled"):
        transformer = trained.get(("transformer", "bf16-mixed", variant))
        ratios = [f"{lstm} {transformer['tgt_tokens_per_s'] / trained[(lstm, 'bf16-mixed', variant)]['tgt_tokens_per_s']:.1f}x"
                  for lstm in ("lstm", "lstm_bahdanau", "lstm_luong")
                  if transformer and (lstm, "bf16-mixed", variant) in trained]
        if ratios:
            lines.append(f"| the Transformer trains 8-12x faster than the LSTMs (target tokens/s) | {variant}: "
                         f"{', '.join(ratios)} | part 2 |")
    for r in _rows(report, "checkpointing"):
        above = r.get("peak_above_start_cut")
        cut = above if above is not None else r["peak_cut"]
        larger = f"{1 / (1 - cut):.1f}x the batch in the same memory" if cut < 1 else "–"
        lines.append(f"| gradient checkpointing: a 4x larger batch for about 40% more time | {r['model']}: activation "
                     f"memory {pct(cut)} less ({larger}), {r['on']['step_ms'] / r['off']['step_ms'] - 1:+.0%} time per "
                     f"step | part 5 |")
    fp32, bf16 = trained.get(("transformer", "32-true", "eager")), trained.get(("transformer", "bf16-mixed", "eager"))
    if fp32 and bf16 and finite(fp32.get("peak_mb")) and finite(bf16.get("peak_mb")):
        lines.append(f"| mixed precision lowers training memory | transformer peak {_num(fp32['peak_mb'])} MB in 32-true, "
                     f"{_num(bf16['peak_mb'])} MB in bf16-mixed ({bf16['peak_mb'] / fp32['peak_mb']:.2f}x) | part 2 |")
    if len(lines) == 4:
        lines.append("| | not measured: the parts behind the claims did not run | |")
    return lines + [""]

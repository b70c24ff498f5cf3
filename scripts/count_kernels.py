"""Kernels launched per training step and per decoding step, counted with the torch profiler on the
CPU: the host-side work a GPU step waits on, measurable where no GPU is.

    python scripts/count_kernels.py                       # the four presets and transformer_base
    python scripts/count_kernels.py --models transformer   # these rows again, the others kept
    python scripts/count_kernels.py --decoding-only        # beam search's columns again, training's kept

Each model is built at its preset's sizes with ``kernels=reference`` (the path a GPU runs), on a
batch of 16 sentences padded to 24 tokens a side (a bucketed shape). Counted, per step:

- training, eager: forward, backward and a fused Adam step, as today's GPU path runs them;
- training, compiled: the same with the teacher-forced pass under ``torch.compile`` (inductor, its
  generated kernels profiled as the ``compile=auto`` GPU path runs them; dynamic shapes);
- decoding: one beam search (beam 5) over the batch's first 8 sentences, divided by its decoder
  steps, with the host synchronisations per step (``item``, ``nonzero``, ``is_nonzero``: each one a
  wait for the GPU), with ``decoding.engine=loop`` and with ``graphs`` (fixed shapes).

A kernel is a leaf event of the profile that computes: an ``aten`` operator other than a view or an
allocation, or a kernel inductor generated (``cpp_fused_*`` here, ``triton_*`` on a GPU). Writes
``<out>/kernels.json`` and ``.md`` (default out: docs/results/kernels).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import Counter
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict
from torch.profiler import ProfilerActivity, profile

from nmt import CONF_DIR, register_resolvers
from nmt.data.batching import collate
from nmt.data.shapes import ShapeBuckets
from nmt.decoding.search import beam_search
from nmt.training.builders import instantiate_model
from nmt.training.lit_module import TranslationModule

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["lstm", "lstm_bahdanau", "lstm_luong", "transformer", "transformer_base"]
VOCAB = 1000
# leaf operators that launch no kernel: views, aliases, allocations, dtype no-ops
NOT_KERNELS = {"aten::view", "aten::as_strided", "aten::resolve_conj", "aten::resolve_neg", "aten::empty",
               "aten::empty_strided", "aten::empty_like", "aten::detach", "detach", "aten::_unsafe_view", "aten::expand",
               "aten::t", "aten::transpose", "aten::reshape", "aten::unsqueeze", "aten::squeeze", "aten::select",
               "aten::slice", "aten::permute", "aten::alias", "aten::split", "aten::chunk", "aten::unbind",
               "aten::narrow", "aten::lift_fresh", "aten::_reshape_alias", "aten::to", "aten::set_", "aten::result_type",
               "aten::is_same_size", "aten::_has_compatible_shallow_copy_type", "aten::size", "aten::stride",
               "aten::contiguous", "aten::numpy_T", "aten::unflatten", "aten::flatten", "aten::movedim", "aten::view_as",
               "aten::expand_as", "aten::split_with_sizes", "aten::_nested_tensor_from_mask_left_aligned"}
SYNCS = {"aten::_local_scalar_dense", "aten::nonzero"}  # a tensor's value read on the host (item, bool(), if)


def count(prof) -> tuple[int, Counter]:
    """Kernels in a profile (leaf computing events) and the host synchronisations."""
    kernels, syncs = 0, Counter()
    for event in prof.events():
        if event.name in SYNCS and not under(event, "aten::_fused_adam_"):  # a CPU artifact: on CUDA the
            syncs[event.name] += 1                                           # step counts stay on the device
        if event.cpu_children:
            continue
        name = event.name
        if "cpp_fused" in name or name.startswith("triton_") or (name.startswith("aten::") and name not in NOT_KERNELS):
            kernels += 1
    return kernels, syncs


def under(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def build(preset: str) -> torch.nn.Module:
    choice = "experiment=transformer_base" if preset == "transformer_base" else f"model={preset}"
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["hydra.runtime.output_dir=.", choice], return_hydra_config=True)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = VOCAB
    torch.manual_seed(0)
    return instantiate_model(cfg.model).set_kernels("reference")


def batch(rows: int = 16, length: int = 23) -> dict:
    generator = torch.Generator().manual_seed(0)
    lengths = [(length - i % 5, length - (i * 3) % 7) for i in range(rows)]
    items = [(i, torch.randint(4, VOCAB, (s,), generator=generator).numpy(),
              torch.randint(4, VOCAB, (t,), generator=generator).numpy()) for i, (s, t) in enumerate(lengths)]
    return collate(items, shapes=ShapeBuckets(4096))


def training_kernels(model: torch.nn.Module, data: dict, compiled: bool) -> dict:
    model.train()
    if compiled:
        model.compile_features(dynamic=True)
    module = TranslationModule(model, optimizer=functools.partial(torch.optim.Adam))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        module.loss(data)[0].backward()
        optimizer.step()

    start = time.perf_counter()
    step()  # compiles, when compiled
    warm = time.perf_counter() - start
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    kernels, syncs = count(prof)
    out = {"kernels": kernels, "syncs": sum(syncs.values()), "first_step_s": round(warm, 1)}
    if getattr(model.decoder, "attention", None) is not None and getattr(model.decoder, "input_feeding", "none") != "none":
        memory = {k: v.detach() if torch.is_tensor(v) else v for k, v in model.encode(data["src"], data["src_mask"]).items()}
        model.decoder.features(data["tgt_in"], memory).sum().backward()  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.decoder.features(data["tgt_in"], memory).sum().backward()
        out["decoder_loop_kernels"] = count(prof)[0]
    return out


@torch.no_grad()
def decoding_kernels(model: torch.nn.Module, data: dict) -> dict:
    """Beam search's kernels and host reads per decoder step, with the loop (``decoding.engine=loop``,
    the search before fixed shapes) and with ``graphs`` (fixed shapes, padded; on a GPU each step is
    one graph replay, so its kernels are launched by the GPU, not by the host)."""
    model.eval()
    src = data["src"][:8]
    out = {}
    for engine in ("loop", "graphs"):
        steps = []
        decode_step = model.decode_step
        model.decode_step = lambda *args, **kwargs: steps.append(1) or decode_step(*args, **kwargs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            beam_search(model, src, src != 0, beam_size=5, max_len_a=0.0, max_len_b=24, engine=engine)
        del model.decode_step
        kernels, syncs = count(prof)
        out[engine] = {"steps": len(steps), "kernels_per_step": round(kernels / len(steps), 1),
                       "syncs_per_step": round(sum(syncs.values()) / len(steps), 2), "syncs": dict(syncs)}
    return {**out["loop"], "graphs": out["graphs"]}


def markdown(rows: list[dict]) -> str:
    lines = ["# Kernels per step (CPU profiler)", "",
             "`python scripts/count_kernels.py`: leaf computing events of one training step (forward, backward, fused "
             "Adam) and of beam search (beam 5, 8 sentences), per step; the presets' sizes, `kernels=reference`, a "
             "16 x 24-token batch. Compiled: the teacher-forced pass under `torch.compile` (inductor, dynamic shapes), "
             "as `compile=auto` runs it on a GPU.", "",
             "| model | training step, eager | compiled | ratio | decoder loop, eager | compiled | ratio "
             "| first compiled step (s) | host syncs per training step | beam search kernels per step | host syncs per step "
             "| fixed shapes: kernels per step | host syncs per step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        e, c, d = r["eager"], r["compiled"], r["decoding"]
        loop = (f"{e['decoder_loop_kernels']:,} | {c['decoder_loop_kernels']:,} | "
                f"{e['decoder_loop_kernels'] / c['decoder_loop_kernels']:.1f}x") if "decoder_loop_kernels" in e else " | | "
        lines.append(f"| {r['model']} | {e['kernels']:,} | {c['kernels']:,} | {e['kernels'] / c['kernels']:.1f}x | {loop} | "
                     f"{c['first_step_s']:.0f} | {c['syncs']} | {d['kernels_per_step']:,.0f} | {d['syncs_per_step']:.1f} | "
                     f"{d['graphs']['kernels_per_step']:,.0f} | {d['graphs']['syncs_per_step']:.2f} |")
    lines += ["", "On a CPU, torch computes `nn.LSTM` (the encoders, and the plain LSTM's decoder) as per-step "
              "operations with their own backward, which dominate the LSTM models' step counts; on a GPU cuDNN "
              "runs each call as a few fused kernels, and compiling leaves those calls to it (dynamo does not trace "
              "`nn.LSTM`). The decoder loop columns count the attention decoders' teacher-forced loop alone "
              "(forward and backward over a fixed memory), the part `compile` changes for them. Beam search: "
              "`decoding.engine=loop` (the CPU's default) against `graphs` (fixed shapes, eager on a CPU); on a "
              "GPU, `graphs` replays each step as one CUDA graph, so the host launches one graph per step instead "
              "of the kernels counted here."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "kernels")
    parser.add_argument("--decoding-only", action="store_true",
                        help="measure beam search alone; the training columns are kept from <out>/kernels.json")
    args = parser.parse_args()
    register_resolvers()
    import torch._inductor.config as inductor

    inductor.cpp.enable_kernel_profile = True  # each generated kernel an event of the profile
    rows = []
    data = batch()
    path = args.out / "kernels.json"
    before = {r["model"]: r for r in json.loads(path.read_text())["rows"]} if path.is_file() else {}
    for preset in args.models:
        if args.decoding_only and preset in before:
            row = {**before[preset], "decoding": decoding_kernels(build(preset), data)}
        else:
            row = {"model": preset, "eager": training_kernels(build(preset), data, False),
                   "compiled": training_kernels(build(preset), data, True), "decoding": decoding_kernels(build(preset), data)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    if path.is_file():  # --models: the other models' rows measured before are kept
        measured = {r["model"]: r for r in rows}
        kept = [r for r in json.loads(path.read_text())["rows"] if r["model"] not in measured]
        rows = sorted(kept + rows, key=lambda r: MODELS.index(r["model"]))
    path.write_text(json.dumps({"command": "python scripts/count_kernels.py", "rows": rows}, indent=2) + "\n")
    text = markdown(rows)
    (args.out / "kernels.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

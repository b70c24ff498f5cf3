"""The GPU path in one run of a few minutes: speed, mixed precision, attention kernels, memory,
decoding and loss parity, written to ``docs/results/gpu/<gpu name>.md`` (and ``.json``).

    scripts/gpu_check.sh [--dry-run] [--out DIR]        # this script under `timeout`
    python scripts/gpu_check.py [--dry-run] [--out DIR] [--device cuda|cpu] [--parts presets,parity]

Parts, each with a time cap (``BUDGET`` in ``nmt.bench.gpu.check``) inside one deadline for the
whole run:

1. ``env``: GPU, memory, torch/CUDA/cuDNN/Lightning versions; matmul peak FLOP/s in bf16 and fp16
   (``nmt.bench.measure.matmul_peak``), measured in this run.
2. ``presets``: the four model presets in ``bf16-mixed``, each eager on exact shapes (the path
   before the GPU levers: ``compile=false data.shapes=exact``) and compiled on shape buckets
   (``compile=auto data.shapes=auto``, a GPU run's defaults), the Transformer also with CUDA graphs
   (``compile=cudagraphs``) and eager in ``32-true`` (what mixed precision saves in memory), 200
   optimizer steps each on the synthetic data through ``nmt.train.train`` (``trainer=gpu``, no
   validation, test, logger or checkpoints). A callback (``StepRecorder``) times the batches (CUDA
   synchronized) and keeps their lengths: steady-state target tokens/s after ``warmup`` batches,
   model FLOP/s (``nmt.bench.flops.training_flops`` on the real tokens of the batches) against the
   matmul peak of the same dtype, peak CUDA memory, the final loss, the graphs compiled and the
   seconds compiling took, the batch shapes of an epoch; and each variant's speed against eager.
3. ``base``: ``experiment=transformer_base`` in ``bf16-mixed`` the same way, eager, compiled and
   compiled at the batch ``data.max_tokens=auto`` finds (target >= 30% of the peak; the attention
   LSTMs' target is >= 25%).
4. ``sdpa``: a Transformer forward/backward with ``sdpa_kernel`` restricted to one backend at a
   time, SDPA alone per kind of call (padding mask, causal, none), and the attention kernels the
   torch profiler saw in one training step.
5. ``checkpointing``: peak memory (and bytes saved for backward) of a few training steps with
   ``model.gradient_checkpointing`` false vs true, same weights and batches: transformer_base and
   lstm_bahdanau.
6. ``kv_cache``: beam 5 at batch 64 through ``decoding.engine=loop``, through ``graphs`` (fixed
   shapes, one CUDA graph per step, captured in a warm-up on the same batch), through the loop
   without the key/value cache (``nmt.bench.decoding.NoCache``; the cache factor is graphs against
   it, target >= 3x), and through CTranslate2 on the same weights (the ``nmt-export`` conversion in
   float16, one ``translate_batch`` of the same sentences; our faster engine against it, target >=
   0.5x), with the share of outputs equal to the loop's (bf16); the same batch in fp32 (TF32 off), where
   ``graphs`` must give the loop's hypotheses, captured and replayed, or the part fails; and the host's
   work per decoding step of the loop and of ``graphs`` (one profiled search: aten operators, CUDA
   launches, reads of a value). Its models are those parts 2-3 trained.

After the parts, a table holds the seeds' claims against this run's rows: the Transformer against the
LSTMs in training speed (part 2), gradient checkpointing's memory and time (part 5), mixed
precision's memory (part 2).
7. ``parity``: for a fixed batch and weights (seeded, then 5 Adam steps on that batch so that the
   predictions are no longer uniform), ``module.loss`` with ``kernels=reference`` on the CPU in
   fp32 against the same weights on the device with the training default ``kernels=auto`` in fp32
   (TF32 off) and under bf16 autocast, per preset.

8. ``attention``: the self-attention patterns' cost curve (``nmt.bench.attention_cost``) in bf16,
   n from 64 to 4,096: forward+backward time of an attention layer and an encoder layer, peak
   memory, fitted exponents and crossover lengths against full attention.

Part 4 runs last (the report keeps the numbering).

A failing part is recorded (its exception) and the others still run; the report is rewritten
after every part, so a run cut short keeps what it measured.

``--dry-run`` runs the same code on the CPU, tiny: 16-wide models, 4 steps, a 2,000-pair synthetic
corpus, results in a temporary folder (or ``--out``); its compiled variants trace the graphs
(``compile=trace``) instead of generating code. On the CPU ``kernels=auto`` means the CPU kernels,
so the parity part compares them with the reference path. ``--dry-run --device cuda`` is the tiny
run on a GPU: a one-minute smoke test of every CUDA call.

The code is in ``nmt/bench/gpu/``, a module per part (``env``, ``training`` with its callback in
``recorder``, ``sdpa``, ``checkpointing``, ``kv_cache``, ``parity``, ``attention``), ``check`` (the mode, the time
caps and the loop over the parts) and ``report`` (the markdown); this script picks the parts.
"""

from __future__ import annotations

import time

START = time.perf_counter()  # the deadline counts from here, the imports included

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from nmt import register_resolvers  # noqa: E402
from nmt.bench.gpu import attention, checkpointing, env, kv_cache, parity, sdpa, training  # noqa: E402
from nmt.bench.gpu.check import DEADLINE, Check, Mode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The parts in the order they run. Part 4 runs last: forcing one SDPA backend at a time is the most
# exotic path, and a crash there (not an exception, which is recorded) would lose only itself.
PARTS = {"env": env.env, "data": env.data, "presets": training.presets, "base": training.base,
         "checkpointing": checkpointing.checkpointing, "kv_cache": kv_cache.kv_cache, "parity": parity.parity,
         "attention": attention.attention, "sdpa": sdpa.sdpa}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, on the CPU unless --device says otherwise")
    parser.add_argument("--out", type=Path,
                        help="where the .md and .json go (default docs/results/gpu; a temporary folder for --dry-run)")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda, or cpu for --dry-run")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    args = parser.parse_args()
    register_resolvers()
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    device = args.device or ("cpu" if args.dry_run else "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --dry-run checks the same code on the CPU", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`.*")
    for name in ("pytorch_lightning", "lightning_fabric"):  # "GPU available", "Seed set to": once per training
        logging.getLogger(name).setLevel(logging.WARNING)
    mode = Mode.make(device, tiny=args.dry_run)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out = args.out or (work / "report" if args.dry_run else ROOT / "docs" / "results" / "gpu")
    # Tiny data goes to its own cache; the full run reuses the repository's (.cache/).
    cache = work / "cache" if args.dry_run and not os.environ.get("NMT_CACHE_DIR") else None
    check = Check(mode, out, work, cache, START)
    check.say(f"gpu_check: {check.report['name']} ({'dry run, tiny' if mode.tiny else 'full'}), parts {','.join(parts)}, "
              f"deadline {DEADLINE} s; report {out / check.name}.md")
    try:
        check.run({key: part for key, part in PARTS.items() if key in parts})
    finally:
        check.report["elapsed_s"] = round(check.elapsed(), 1)
        check.write()
        check.clean_up()
    failed = [k for k, p in check.report["parts"].items() if p["status"] != "ok"]
    check.say(f"done in {check.elapsed():.0f} s; {'all parts ok' if not failed else 'not ok: ' + ', '.join(failed)}; "
              f"wrote {out / check.name}.md and .json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

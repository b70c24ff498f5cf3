"""``compile``: whether and how the teacher-forced training pass runs under ``torch.compile``.

- ``auto``: compiled on a GPU, where a step is otherwise bound by the host launching hundreds of
  small kernels (eager where Triton, which inductor generates GPU code with, is missing or does not
  support the GPU; logged); eager on a CPU, where compiling measured slower (0.86x, docs/performance.md).
- ``true``: compiled on any device; ``false``: eager.
- ``cudagraphs``: compiled with ``mode="reduce-overhead"``, which replays each shape's kernels as
  one CUDA graph; it needs the bounded shapes of ``data.shapes=buckets``.
- ``trace``: the graphs ``torch.compile`` captures (graph breaks, recompilations) run through AOT
  autograd without generating code (backend ``aot_eager``): a check, in seconds on a CPU, of what a
  GPU run compiles (the GPU check's dry run uses it).

The graphs are compiled with dynamic shapes (a batch's rows and length are symbols), so a run
compiles a few graphs, not one per batch shape: an epoch of Europarl holds about 40 bucketed shapes,
and a static graph each would cost tens of minutes of compiling on a GPU. ``data.shapes=buckets``
still bounds the shapes, which is what ``cudagraphs`` needs: a CUDA graph is recorded (cheaply,
without compiling) per shape and replayed for every batch of it. A Transformer compiles its whole pass; an RNN decoder that feeds attention back into its
recurrence compiles its step (``RNNDecoder.compile_step``), which does not depend on the sentence
length, instead of a graph unrolled over every target length. What compiling cost is logged at the
end of training and kept in ``summary.json`` (``compile_summary``).

The compiled pass checks itself (``checked_loss``): the first training batch runs the eager pass too,
from the same random state, and a loss off by more than ``LOSS_TOLERANCE`` of the eager one logs one
warning and trains eager for the rest of the run. Dropout inside a compiled graph draws its own random
numbers (inductor's), so the two passes drop different units and the tolerance is loose: it catches a
pass that computes something else, not a last-digit drift (the parity tests hold that).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

CHOICES = ("auto", "true", "false", "cudagraphs", "trace")
RECOMPILE_LIMIT = 64  # graphs per compiled function (torch's default, 8, falls back to eager past it)
LOSS_TOLERANCE = 0.05  # relative: the compiled pass's first loss against the eager one (dropout masks differ)


@dataclass(frozen=True)
class CompilePlan:
    """How the training pass is compiled: ``dynamic`` shapes or one graph per shape, the
    ``torch.compile`` mode (None: the default) and backend."""

    dynamic: bool
    mode: str | None
    backend: str = "inductor"

    def describe(self) -> str:
        return f"torch.compile(dynamic={self.dynamic}, mode={self.mode or 'default'}, backend={self.backend})"


def resolve_compile(value: Any, device: str, shapes: str, gpu_compiler: bool = True) -> CompilePlan | None:
    """The plan for config ``compile`` on ``device`` (cpu, cuda) with resolved ``data.shapes``
    (exact or buckets); None: eager. ``gpu_compiler``: whether inductor can generate code for this
    GPU (Triton installed and the GPU supported, ``gpu_compiler_available``): ``auto`` trains eager
    without it, logged, and ``true``/``cudagraphs`` are refused."""
    choice = str(value).lower() if not isinstance(value, bool) else ("true" if value else "false")
    if choice not in CHOICES:
        raise ValueError(f"compile={value}: choose {', '.join(CHOICES)}")
    if choice == "false" or (choice == "auto" and device != "cuda"):
        return None
    if device == "cuda" and choice != "trace" and not gpu_compiler:
        if choice == "auto":
            log.info("compile=auto: torch.compile cannot generate code for this GPU (no Triton, or a GPU it does not "
                     "support); training eager")
            return None
        raise ValueError(f"compile={value}: torch.compile generates GPU code with Triton, which is not installed or "
                         "does not support this GPU (pip install triton); use compile=auto or false")
    if choice == "cudagraphs":
        if device != "cuda":
            raise ValueError(f"compile=cudagraphs: CUDA graphs need a GPU, and this run trains on {device}; "
                             "use compile=true or auto")
        if shapes != "buckets":
            raise ValueError("compile=cudagraphs: a CUDA graph replays one shape, and data.shapes=exact makes a "
                             "shape per batch; set data.shapes=buckets (or auto)")
        return CompilePlan(dynamic=True, mode="reduce-overhead")
    if choice == "trace":
        return CompilePlan(dynamic=True, mode=None, backend="aot_eager")
    return CompilePlan(dynamic=True, mode=None)


def gpu_compiler_available() -> bool:
    """Whether inductor can generate code for the current GPU: Triton importable and the GPU of a
    compute capability it supports (7.0 and later)."""
    import torch

    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(torch.cuda.is_available() and torch.cuda.get_device_capability() >= (7, 0) and has_triton())


def allow_recompiles() -> None:
    """Room for the graphs a run compiles: dynamic shapes still specialise (a batch of one row, a
    precision change), and torch's default of 8 graphs a function falls back to eager without an
    error past it. Process-wide: called by the entry point."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed in torch 2.6
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)


def compile_counters() -> dict[str, float]:
    """This process's compilation totals so far: graphs compiled and seconds spent compiling."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "seconds": float(sum(compilation_time_metrics.get("_compile.compile_inner", []) or [0.0]))}


def compile_summary(plan: CompilePlan | None, before: dict[str, float], batch_shapes: int | None) -> dict[str, Any] | None:
    """What compiling cost in this run, logged and returned for ``summary.json``: graphs compiled,
    seconds, and the distinct batch shapes of an epoch (CUDA graphs recorded, with ``cudagraphs``)."""
    if plan is None:
        return None
    now = compile_counters()
    summary = {"plan": plan.describe(), "graphs": now["graphs"] - before["graphs"],
               "seconds": round(now["seconds"] - before["seconds"], 1), "batch_shapes_per_epoch": batch_shapes}
    log.info("compiled: %d graph(s) in %.1f s (%s; %s batch shapes an epoch)", summary["graphs"], summary["seconds"],
             plan.describe(), "?" if batch_shapes is None else batch_shapes)
    return summary


def checked_loss(model: Any, losses: Callable[[], tuple], tolerance: float = LOSS_TOLERANCE) -> tuple:
    """``losses()`` (a tuple, the loss first) of a training batch through ``model``'s compiled pass,
    checked against the eager pass on the same batch from the same random state (without gradients);
    beyond ``tolerance`` (relative), one warning, ``model.drop_compiled()`` and the eager pass's
    ``losses()`` (with gradients), so this batch and the rest of the run train eager."""
    import torch

    before = _rng_states()
    compiled = losses()
    after = _rng_states()
    _set_rng_states(before)
    with torch.no_grad():  # the compiled pass serves gradients only: this is the eager one
        eager = losses()
    a, b = float(compiled[0].detach()), float(eager[0])
    difference = abs(a - b) / max(abs(b), 1e-6)
    if difference <= tolerance:  # (NaN compares false: a NaN from one pass alone is a disagreement)
        _set_rng_states(after)
        return compiled
    log.warning("compile: the compiled training pass's first loss %.6g differs from the eager pass's %.6g by %.3g "
                "(relative; tolerance %.3g); training runs eager from here on", a, b, difference, tolerance)
    model.drop_compiled()
    _set_rng_states(before)
    return losses()


def _rng_states() -> tuple:
    import torch

    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _set_rng_states(states: tuple) -> None:
    import torch

    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state_all(states[1])

"""CPU kernels: faster ways to compute what the plain PyTorch models in ``nmt.models`` compute.

``nmt.models`` is written as the papers read (``nn.LSTM`` over packed sequences, ``nn.Dropout``,
``torch.tanh``, SDPA, logits and ``F.cross_entropy``): that is the path on GPUs, where cuDNN and
the fused attention kernels are the fast ones. On CPUs, torch's general kernels leave time on
the table, and this package holds what was measured to win there:

- ``lstm``: the LSTM encoder stepped through time on ``nn.LSTM``'s own weights (both directions
  in one batched matmul, no packed-sequence buffers), the decoder's step as one matmul on
  weights cast once per sequence, the cell as one autograd node, a recurrent weight's gradient
  as one matmul over all steps, and ``tanh`` from ``sigmoid`` (~6x faster on CPU);
- ``dropout``: masks from 16-bit uniforms, a quarter of the random draws;
- ``attention``: Bahdanau's additive score by hand, recomputed in the backward pass;
- ``sdpa``: attention of decoding steps as plain matmuls, fp32 attention under bf16 autocast;
- ``loss``: the output layer and label-smoothed cross-entropy as one blocked autograd node;
- ``int8``: int8 matmuls for decoding (``precision=int8``);
- ``malloc``: keep freed memory in the process (glibc), so large tensors are not page-faulted
  in at every step.

One config key chooses, ``kernels``: ``reference`` (plain PyTorch everywhere), ``cpu`` (these
kernels on any device) or ``auto`` (the default: these kernels for tensors on a CPU, plain
PyTorch elsewhere). Both paths compute the same function; the tests check each against the
other. A module that can use a kernel holds its own choice (``Switchable.kernels``), set for a
whole model by ``nmt.models.base.Seq2Seq.set_kernels``.
"""

from __future__ import annotations

from torch import Tensor

MODES = ("auto", "reference", "cpu")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def active(mode: str, x: Tensor) -> bool:
    """Whether to use a CPU kernel on ``x``: always for ``cpu``, on CPU tensors for ``auto``."""
    return mode == "cpu" or (mode == "auto" and x.device.type == "cpu")


def on_cpu(mode: str, device: str) -> bool:
    """Whether a process computing on ``device`` (``cpu``, ``cuda``, ...) uses the CPU kernels:
    the process-wide settings (``malloc``) follow this."""
    return mode == "cpu" or (mode == "auto" and device == "cpu")


class Switchable:
    """Mixin of modules with a CPU kernel: ``kernels`` is the module's mode (see ``MODES``)."""

    kernels: str = "auto"

    def fast(self, x: Tensor) -> bool:
        return active(self.kernels, x)

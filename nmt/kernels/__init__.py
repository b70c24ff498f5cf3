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

A model computes through one ``Kernels`` object: ``nmt.models.base.Seq2Seq`` makes it and hands
it to every module that has a choice (``UsesKernels``), the training loss
(``nmt.training.lit_module``) and decoding's log-probabilities (``nmt.decoding.search``) ask the model's, and
``Seq2Seq.set_kernels`` / ``quantize_int8`` change it once for all of them. ``kernels.ops(x)``
gives the operations for a tensor: ``ReferenceOps`` (``reference.py``, plain PyTorch), ``CPUOps``
(``cpu.py``, these kernels) or, after ``use_int8``, ``Int8Ops`` (the CPU kernels with int8
matmuls). One config key chooses the mode, ``kernels``: ``reference`` (plain PyTorch
everywhere), ``cpu`` (these kernels on any device) or ``auto`` (the default: these kernels for
tensors on a CPU, plain PyTorch elsewhere). Both paths compute the same function; the tests check
each against the other.
"""

from __future__ import annotations

from torch import Tensor

from nmt.kernels.cpu import CPU, CPUOps, Int8Ops
from nmt.kernels.reference import REFERENCE, ReferenceOps

MODES = ("auto", "reference", "cpu")
INT8_NEEDS_CPU_KERNELS = "precision=int8 runs the CPU kernels: set kernels=auto or kernels=cpu, not reference"

__all__ = ["INT8_NEEDS_CPU_KERNELS", "MODES", "CPUOps", "Int8Ops", "Kernels", "ReferenceOps", "UsesKernels",
           "check_mode", "on_cpu"]


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def on_cpu(mode: str, device: str) -> bool:
    """Whether a process computing on ``device`` (``cpu``, ``cuda``, ...) uses the CPU kernels:
    the process-wide settings (``malloc``) follow this."""
    return mode == "cpu" or (mode == "auto" and device == "cpu")


class Kernels:
    """The implementation a model computes with: ``mode`` (see ``MODES``), and int8 matmuls on
    top of the CPU kernels once ``use_int8`` has been called (inference on CPUs)."""

    def __init__(self, mode: str = "auto") -> None:
        self._int8: Int8Ops | None = None
        self.mode = mode

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if self._int8 is not None and mode == "reference":
            raise ValueError(INT8_NEEDS_CPU_KERNELS)
        self._mode = check_mode(mode)

    @property
    def int8(self) -> bool:
        return self._int8 is not None

    def use_int8(self) -> None:
        """Int8 matmuls from now on (``nmt.kernels.int8``), on every device's tensors: the caller
        (``Seq2Seq.quantize_int8``) has checked the model is on a CPU."""
        if self._mode == "reference":
            raise ValueError(INT8_NEEDS_CPU_KERNELS)
        self._int8 = Int8Ops()

    def ops(self, x: Tensor) -> ReferenceOps:
        """The operations to compute on ``x`` with: int8, the CPU kernels (``cpu``, or ``auto`` on
        a CPU tensor) or plain PyTorch."""
        if self._int8 is not None:
            return self._int8
        return CPU if on_cpu(self._mode, x.device.type) else REFERENCE

    def __repr__(self) -> str:
        return f"Kernels(mode={self._mode!r}, int8={self.int8})"


class UsesKernels:
    """Mixin of modules that compute through a ``Kernels``: a module built alone has its own
    (``auto``); ``Seq2Seq`` gives all of its modules the model's one object."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kernels = Kernels()

"""``nn.Dropout`` computed through the model's kernels (``nmt.kernels``): with the CPU kernels,
masks from 16-bit uniforms (``nmt.kernels.dropout``)."""

from __future__ import annotations

from torch import Tensor, nn

from nmt.kernels import UsesKernels


class Dropout(UsesKernels, nn.Dropout):
    """``nn.Dropout`` (same arguments and state)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.inplace:
            return super().forward(x)
        return self.kernels.ops(x).dropout(x, self.p, self.training)

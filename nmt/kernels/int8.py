"""Int8 inference on CPUs: every ``nn.Linear`` of a model, and an RNN decoder's step matmuls,
multiply in int8 with int32 accumulation (``torch._int_mm``, 2x the bf16 matmul throughput of an
AVX-512 VNNI CPU), as CTranslate2 and Marian decode on CPUs.

Weights are quantized once, symmetrically per output channel; activations on the fly,
symmetrically per row (token): ``x @ W^T ~ (s_x s_W) (q_x @ q_W^T)`` with ``q = round(127 x / max|x|)``.
An LSTM encoder's input projections are int8 too; embeddings, layer norms, attention's own
matmuls, the LSTM cells and the encoder's recurrence stay in floating point.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row of ``x`` (..., K): the codes and the (..., 1) fp32 scales, with
    ``x ~ codes * scale``; an all-zero row gets scale 1."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).div_(127.0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x / scale).round_().to(torch.int8), scale


class Int8Linear(nn.Module):
    """``x @ weight^T + bias`` with an int8 weight (out, in) and int8 activations; returns fp32.
    Built from a float ``nn.Linear`` by ``from_linear``; inference only (no gradients)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        codes, scale = quantize_rows(weight.detach())
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        self.register_buffer("weight_t", codes.t(), persistent=False)  # (in, out), column-major
        self.register_buffer("weight_scale", scale.view(-1), persistent=False)  # (out,)
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        codes, scale = quantize_rows(x.reshape(-1, self.in_features))
        sums = torch._int_mm(codes, self.weight_t)  # int32
        # fp32 in the int32 sums' own memory (both 4 bytes; an elementwise in-place conversion): a
        # decoding step's output layer would otherwise write a fresh (rows, vocabulary) buffer
        y = sums.view(torch.float32).copy_(sums).mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.no_grad()
def quantize_linears(model: nn.Module) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` by an ``Int8Linear`` (a shared weight,
    e.g. a tied output layer, is quantized per module); returns ``model``, set to eval mode.
    Modules with matmuls of their own quantize those themselves
    (``nmt.models.base.Seq2Seq.quantize_int8``)."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("precision=int8 decodes on CPUs only (torch._int_mm); on a GPU use precision=bf16")
    model.eval()
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.out_features > 1:  # not a vector (Bahdanau's v)
                setattr(module, child_name, Int8Linear.from_linear(child))
    return model

"""Int8 inference (``nmt.kernels.int8``): each layer against its float original, and every model's
decoding steps against the float model's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nmt.models.rnn import RNNDecoder, RNNEncoder
from nmt.kernels.int8 import Int8Linear, quantize_rows
from tests.test_models import VARIANTS, batch, build, step_by_step


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_int8_linear_matches_the_float_layer():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight[0] *= 1000  # one large output channel: scales are per channel
    q = Int8Linear.from_linear(linear)
    x = torch.randn(3, 5, 64)
    x[1, 2] = 0  # an all-zero token
    with torch.no_grad():
        y, ref = q(x), linear(x)
    assert y.shape == (3, 5, 48) and y.dtype == torch.float32
    assert relative_error(y[..., 1:], ref[..., 1:]) < 0.02
    assert relative_error(y[..., 0], ref[..., 0]) < 0.02
    torch.testing.assert_close(y[1, 2], linear.bias.detach())  # zero in, bias out, exactly
    codes, scale = quantize_rows(x.view(-1, 64))  # the int32 sums converted in place: exact
    sums = torch._int_mm(codes, q.weight_t).float()
    torch.testing.assert_close(y.view(-1, 48), sums * scale * q.weight_scale + q.bias, atol=0, rtol=0)
    assert not torch.equal(y, ref)  # it does compute in int8


@pytest.mark.parametrize("name", VARIANTS)
def test_int8_decoding_steps_stay_close_to_float(name):
    model = build(name)
    q = copy.deepcopy(model).quantize_int8()
    assert not [n for n, m in q.named_modules() if isinstance(m, nn.Linear) and m.out_features > 1]
    if isinstance(q.decoder, RNNDecoder):  # its step matmuls too
        assert q.kernels.int8 and not model.kernels.int8
    src, src_mask, tgt_in = batch()
    if isinstance(q.encoder, RNNEncoder):  # and an LSTM encoder's input projections
        assert q.encoder.kernels is q.kernels
        with torch.no_grad():
            enc = {key: m.encoder(src, src_mask)["enc_out"] for key, m in (("float", model), ("int8", q))}
        assert relative_error(enc["int8"], enc["float"]) < 0.05 and not torch.equal(enc["int8"], enc["float"])
    with torch.no_grad():
        logits = {key: step_by_step(m, src, src_mask, tgt_in) for key, m in (("float", model), ("int8", q))}
    assert relative_error(logits["int8"], logits["float"]) < 0.05
    assert not torch.equal(logits["int8"], logits["float"])
    with torch.no_grad():  # the teacher-forced pass too
        assert relative_error(q(src, src_mask, tgt_in), model(src, src_mask, tgt_in)) < 0.05


def test_int8_refuses_a_model_off_the_cpu():
    model = build("transformer").to("meta")
    with pytest.raises(ValueError, match=r"precision=int8 decodes on CPUs only \(torch._int_mm\); on a GPU use precision=bf16"):
        model.quantize_int8()


def test_int8_refuses_the_reference_kernels():
    model = build("transformer").set_kernels("reference")
    with pytest.raises(ValueError, match="precision=int8 runs the CPU kernels: set kernels=auto or kernels=cpu, not reference"):
        model.quantize_int8()

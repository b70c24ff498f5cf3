"""The CPU dropout with the cheaper mask: right keep rate, scale and gradient."""

from __future__ import annotations

import pytest
import torch

from nmt.kernels.dropout import dropout
from nmt.models.dropout import Dropout


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_keeps_one_minus_p_and_preserves_the_mean(p):
    torch.manual_seed(0)
    y = dropout(torch.ones(1000, 1000), p)
    kept = (y != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 0.002  # 1M Bernoulli draws: sd ~0.0005
    assert abs(y.mean().item() - 1) < 0.003
    assert torch.allclose(y[y != 0], torch.tensor(1 / (1 - p)), rtol=1e-4)


def test_masks_differ_across_calls_and_positions():
    torch.manual_seed(0)
    a, b = dropout(torch.ones(4096, 64), 0.5), dropout(torch.ones(4096, 64), 0.5)
    assert not torch.equal(a, b)
    per_column = (a != 0).double().mean(0)  # sd 0.008: no position is kept more or less often
    assert 0.46 < per_column.min() and per_column.max() < 0.54


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gradient_is_the_forward_mask(dtype):
    torch.manual_seed(1)
    x = torch.randn(7, 5, 33, dtype=dtype, requires_grad=True)
    y = dropout(x, 0.3)
    grad = torch.randn_like(y)
    y.backward(grad)
    assert y.dtype == dtype
    scale = (y / x.detach()).nan_to_num()  # 0 where dropped, 1 / (1 - p) where kept
    torch.testing.assert_close(x.grad, grad * scale)


def test_identity_in_eval_and_at_zero_all_dropped_at_one():
    x = torch.randn(4, 6)
    module = Dropout(0.3).eval()
    assert module(x) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    assert torch.equal(dropout(x, 0.999999), torch.zeros_like(x))  # rounds to 1 in 2^-16 steps
    with pytest.raises(ValueError, match="between 0 and 1, got 1.5"):
        dropout(x, 1.5)


def test_module_is_a_drop_in_for_nn_dropout():
    module = Dropout(0.25)
    assert isinstance(module, torch.nn.Dropout) and module.p == 0.25
    assert module.state_dict() == {}

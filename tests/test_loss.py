"""The fused output layer + label-smoothed cross-entropy equals torch's, in value and gradient,
whatever the block size, in fp64 and under bf16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nmt.kernels.loss import output_cross_entropy


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("block_rows", [1, 7, 50, None])
def test_equals_torch_linear_and_cross_entropy(eps, block_rows):
    hidden = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 37, (50,))
    loss, nll = output_cross_entropy(hidden, weight, target, eps, block_rows)
    logits = F.linear(hidden, weight)
    ref = F.cross_entropy(logits, target, label_smoothing=eps)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(nll, F.cross_entropy(logits, target).detach())
    assert not nll.requires_grad
    for got, want in zip(torch.autograd.grad(3 * loss, (hidden, weight)), torch.autograd.grad(3 * ref, (hidden, weight))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_matches_fp32_with_fp32_loss_and_gradients(dtype):
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = (0.1 * torch.randn(100, 32)).requires_grad_()
    target = torch.randint(0, 100, (64,))
    with torch.autocast("cpu", dtype=dtype):
        loss, _ = output_cross_entropy(hidden, weight, target, 0.1, block_rows=16)
    assert loss.dtype == torch.float32
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref = F.cross_entropy(F.linear(hidden, weight), target, label_smoothing=0.1)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(loss, ref, atol=2e-2, rtol=1e-2)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=2e-4, rtol=5e-2)


def test_without_gradients_the_loss_is_the_same():
    hidden, weight = torch.randn(20, 8), torch.randn(11, 8)
    target = torch.randint(0, 11, (20,))
    with torch.no_grad():
        loss, nll = output_cross_entropy(hidden, weight, target, 0.1, block_rows=6)
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(hidden, weight), target, label_smoothing=0.1))
    torch.testing.assert_close(nll, F.cross_entropy(F.linear(hidden, weight), target))


def test_no_targets_is_an_error():
    with pytest.raises(ValueError, match="no target tokens"):
        output_cross_entropy(torch.zeros(0, 4), torch.zeros(5, 4), torch.zeros(0, dtype=torch.long), 0.1)

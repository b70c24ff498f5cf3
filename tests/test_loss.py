"""The fused label-smoothed cross-entropy equals torch's, in value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nmt.loss import label_smoothed_cross_entropy


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_equals_torch_cross_entropy(eps):
    logits = torch.randn(50, 37, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 37, (50,))
    loss, nll = label_smoothed_cross_entropy(logits, target, eps)
    ref = F.cross_entropy(logits, target, label_smoothing=eps)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(nll, F.cross_entropy(logits, target).detach())
    assert not nll.requires_grad
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0])


def test_bf16_logits_give_an_fp32_loss_and_a_bf16_gradient():
    logits = torch.randn(64, 100).bfloat16().requires_grad_()
    target = torch.randint(0, 100, (64,))
    loss, _ = label_smoothed_cross_entropy(logits, target, 0.1)
    assert loss.dtype == torch.float32
    (grad,) = torch.autograd.grad(3 * loss, logits)
    ref = logits.detach().float().requires_grad_()
    (ref_grad,) = torch.autograd.grad(3 * F.cross_entropy(ref, target, label_smoothing=0.1), ref)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref_grad, atol=1e-4, rtol=1e-2)
    torch.testing.assert_close(loss, F.cross_entropy(ref, target, label_smoothing=0.1))


def test_no_targets_is_an_error():
    with pytest.raises(ValueError, match="no target tokens"):
        label_smoothed_cross_entropy(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), 0.1)

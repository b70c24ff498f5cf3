"""The fused output layer + label-smoothed cross-entropy equals torch's, in value and gradient,
whatever the block size, in fp64 and under bf16 autocast."""

from __future__ import annotations

import math

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


@pytest.mark.parametrize("eps, not_targets", [(0.0, ()), (0.1, ()), (0.1, (0, 2))])
@pytest.mark.parametrize("block_rows", [1, 7, None])
def test_a_bias_adds_to_each_blocks_logits_with_its_gradient(eps, not_targets, block_rows):
    """The bias is added in the kernel (never joined to the weight, which copied the output layer
    each step): loss and gradients of hidden, weight and bias equal the reference kernel's
    ``F.linear(h, W, b)`` with its smoothing (whose softmax runs in fp32)."""
    from nmt.kernels.reference import ReferenceOps

    hidden = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    bias = (3 * torch.randn(37, dtype=torch.float64)).index_fill_(0, torch.tensor([2]), -1e4).requires_grad_()
    target = torch.randint(3, 37, (50,))
    loss, nll = output_cross_entropy(hidden, weight, target, eps, block_rows, not_targets, bias=bias)
    ref, ref_nll = ReferenceOps().output_cross_entropy(hidden, weight, target, eps, not_targets, bias=bias)
    close = {"check_dtype": False, "rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(loss, ref, **close)
    torch.testing.assert_close(nll, ref_nll, **close)
    inputs = (hidden, weight, bias)
    for got, want in zip(torch.autograd.grad(3 * loss, inputs), torch.autograd.grad(3 * ref, inputs)):
        torch.testing.assert_close(got, want, **close)
    with pytest.raises(ValueError, match=r"^output_cross_entropy: a bias of shape \(36,\) for 37 output rows$"):
        output_cross_entropy(hidden, weight, target, eps, bias=bias[:36])


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


def test_smoothing_leaves_out_the_entries_no_target_can_be_by_hand():
    """A vocabulary of 5 whose entries 0 (padding) and 2 (BOS) are never targets: the smoothed
    mass eps goes to the 3 others, eps / 3 each, none to 0 and 2; loss and logit gradients as
    computed by hand, in both kernels."""
    from nmt.kernels.cpu import CPUOps
    from nmt.kernels.reference import ReferenceOps

    eps, z, y = 0.3, [[1.0, -0.5, 2.0, 0.25, 0.0], [0.0, 1.5, -1.0, 0.5, 2.5]], [3, 1]
    want_loss, want_grad = 0.0, []
    for row, target in zip(z, y):
        total = sum(math.exp(v) for v in row)
        log_p = [v - math.log(total) for v in row]
        q = [0.0 if v in (0, 2) else eps / 3 for v in range(5)]  # the smoothed target
        q[target] += 1 - eps
        want_loss += -sum(qv * lp for qv, lp in zip(q, log_p)) / len(z)
        want_grad.append([(math.exp(lp) - qv) / len(z) for lp, qv in zip(log_p, q)])
    for ops in (ReferenceOps(), CPUOps()):
        hidden = torch.eye(2, dtype=torch.float64).requires_grad_()  # (N, H=2)
        weight = torch.tensor(z, dtype=torch.float64).t().contiguous().requires_grad_()  # (V, H): h W^T = z
        loss, nll = ops.output_cross_entropy(hidden, weight, torch.tensor(y), eps, (0, 2))
        assert loss.item() == pytest.approx(want_loss, abs=1e-6), type(ops).__name__  # the reference: fp32 logits
        assert nll.item() == pytest.approx(F.cross_entropy(torch.tensor(z, dtype=torch.float64), torch.tensor(y)).item())
        (grad_weight,) = torch.autograd.grad(loss, (weight,))
        torch.testing.assert_close(grad_weight.t(), torch.tensor(want_grad, dtype=torch.float64), atol=1e-6, rtol=1e-5)  # dL/dz


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("autocast", [False, True])
def test_both_kernels_smooth_over_the_same_entries(eps, autocast):
    """The fused kernel and the reference, with padding and BOS left out of the smoothing: the same
    loss and gradients in fp32 (and close under bf16 autocast), whatever the block size; leaving
    them out changes the loss."""
    from nmt.kernels.loss import output_cross_entropy as fused
    from nmt.kernels.reference import ReferenceOps

    torch.manual_seed(0)
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = (0.3 * torch.randn(37, 16)).requires_grad_()
    target = torch.randint(3, 37, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = ReferenceOps().output_cross_entropy(hidden, weight, target, eps, (0, 2))
        got = [fused(hidden, weight, target, eps, block_rows, (0, 2)) for block_rows in (7, None)]
    tol = {"atol": 2e-2, "rtol": 2e-2} if autocast else {"atol": 1e-6, "rtol": 1e-5}
    ref_grads = torch.autograd.grad(ref[0], (hidden, weight))
    for loss, nll in got:
        torch.testing.assert_close(loss, ref[0], **tol)
        torch.testing.assert_close(nll, ref[1], **tol)
        for g, r in zip(torch.autograd.grad(loss, (hidden, weight)), ref_grads):
            torch.testing.assert_close(g, r, **({"atol": 2e-4, "rtol": 5e-2} if autocast else tol))
    everywhere = F.cross_entropy(F.linear(hidden, weight), target, label_smoothing=eps)
    assert (ref[0] != everywhere) == bool(eps) or autocast


def test_leaving_out_every_entry_or_one_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"^label smoothing: not_targets \[0, 9\] must be entries of a vocabulary of 5"):
        output_cross_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), 0.1, None, (0, 9))

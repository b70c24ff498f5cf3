"""The CPU kernels (``nmt.kernels``) against the plain PyTorch they replace: each kernel alone,
and whole models trained and decoded in both modes."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_models import VARIANTS, VOCAB, batch, build


@pytest.mark.parametrize("bidirectional", [True, False])
def test_stepped_rnn_encoder_equals_nn_lstm_on_packed_sequences(bidirectional):
    """The CPU kernel's recurrence on ``self.rnn``'s weights computes what ``nn.LSTM`` computes
    on packed sequences: outputs (zero on padding), final states and gradients."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    from nmt.kernels import Kernels
    from nmt.models.rnn import RNNEncoder

    torch.manual_seed(0)
    encoder = RNNEncoder(VOCAB, 8, 12, num_layers=2, bidirectional=bidirectional).eval()
    encoder.kernels = Kernels("cpu")
    src, src_mask, _ = batch(lengths=(7, 3, 5))
    packed = pack_padded_sequence(encoder.embed(src), src_mask.sum(1), batch_first=True, enforce_sorted=False)
    out, (h, c) = encoder.rnn(packed)
    ref_out, _ = pad_packed_sequence(out, batch_first=True, total_length=src.size(1))
    dirs = 2 if bidirectional else 1

    def layers(state):  # (L*D, B, h) -> (B, L, D*h)
        return state.view(2, dirs, src.size(0), -1).permute(2, 0, 1, 3).reshape(src.size(0), 2, -1)

    memory = encoder(src, src_mask)
    for key, ref in (("enc_out", ref_out), ("final_h", layers(h)), ("final_c", layers(c))):
        torch.testing.assert_close(memory[key], ref, atol=1e-6, rtol=1e-5)
    params = list(encoder.parameters())
    grads = torch.autograd.grad(sum(m.sin().sum() for m in memory.values() if m.is_floating_point()), params)
    ref_grads = torch.autograd.grad(ref_out.sin().sum() + layers(h).sin().sum() + layers(c).sin().sum(), params)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("steps", [1, 3])
def test_additive_score_matches_tanh_and_autograd(steps):
    """The hand-written additive score is v^T tanh(q + k) with the gradients autograd would give."""
    from nmt.kernels.attention import _AdditiveScore

    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, steps, 5, dtype=torch.double, generator=g, requires_grad=True)
    keys = torch.randn(2, 4, 5, dtype=torch.double, generator=g, requires_grad=True)
    v = torch.randn(5, dtype=torch.double, generator=g, requires_grad=True)
    reference = torch.tanh(keys.unsqueeze(1) + query.unsqueeze(2)) @ v
    torch.testing.assert_close(_AdditiveScore.apply(query, keys, v), reference)
    assert torch.autograd.gradcheck(_AdditiveScore.apply, (query, keys, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.double])
def test_fast_tanh_equals_torch_tanh_to_rounding(dtype):
    """The CPU tanh (2 sigmoid(2x) - 1 in at least fp32) and its gradient match torch.tanh, small
    values included (in bf16 the subtraction alone would round them to 0)."""
    from nmt.kernels.lstm import tanh

    x = torch.cat([torch.linspace(-12, 12, 2001), torch.tensor([1e-3, -3e-3, 1e-2, 5e-2])]).to(dtype).requires_grad_()
    y, ref = tanh(x), torch.tanh(x)
    assert y.dtype == dtype
    tol = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-5, rtol=8e-3), torch.double: dict(atol=1e-12, rtol=1e-10)}[dtype]
    torch.testing.assert_close(y, ref, **tol)
    grad = torch.autograd.grad(y.sum(), x)[0]
    exact = 1 - torch.tanh(x.detach().double()) ** 2  # torch's bf16 backward rounds y first: not a reference
    torch.testing.assert_close(grad.double(), exact, atol=2 * tol["atol"], rtol=2 * tol["rtol"])


@pytest.mark.parametrize("directions", [None, 2])
def test_step_weight_gradient_is_the_sum_of_the_steps(directions):
    """A recurrent weight's gradient from ``StepWeight`` (one matmul after all steps) equals
    autograd's per-step sum, and so do the inputs' gradients; a 2-D weight (decoder layer) and a
    per-direction 3-D one (encoder)."""
    from nmt.kernels.lstm import StepWeight

    gen = torch.Generator().manual_seed(0)
    lead = () if directions is None else (directions,)
    weight = torch.randn(*lead, 6, 6, generator=gen, dtype=torch.double).requires_grad_()
    bias = torch.randn(6, generator=gen, dtype=torch.double).requires_grad_()
    start = torch.randn(*lead, 3, 6, generator=gen, dtype=torch.double).requires_grad_()

    def run(product):
        h = start
        for _ in range(4):
            h = torch.tanh(product(bias.expand_as(h) if directions else bias, h))
        return torch.autograd.grad(h.pow(2).sum(), (weight, bias, start))

    step = StepWeight(weight)
    ours = run(step.product)
    reference = run(lambda add, x: (torch.baddbmm if directions else torch.addmm)(add, x, weight))
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got, want)
    assert not step.record  # the saved steps are released after the backward pass


def test_lstm_cell_node_has_the_gradients_of_its_formula():
    """The training cell's hand-written backward: gradcheck in fp64 (h and c used, each alone),
    and bf16 gates against autograd's fp32 graph of the same formula."""
    from nmt.kernels.lstm import lstm_cell

    gen = torch.Generator().manual_seed(0)
    gates = (torch.randn(5, 4 * 8, generator=gen, dtype=torch.double) * 3).requires_grad_()
    c = torch.randn(5, 8, generator=gen, dtype=torch.double).requires_grad_()
    for pick in (lambda out: out, lambda out: out[0], lambda out: out[1]):
        assert torch.autograd.gradcheck(lambda g, c: pick(lstm_cell(g, c)), (gates, c))

    gates = (torch.randn(7, 4 * 16, generator=gen) * 3).bfloat16().requires_grad_()
    c = torch.randn(7, 16, generator=gen).requires_grad_()
    weights = torch.randn(7, 16, generator=gen), torch.randn(7, 16, generator=gen)
    h_new, c_new = lstm_cell(gates, c)
    assert h_new.dtype == torch.bfloat16 and c_new.dtype == torch.float32
    i, f, g, o = gates.float().chunk(4, dim=-1)
    c_ref = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h_ref = torch.sigmoid(o) * torch.tanh(c_ref)
    torch.testing.assert_close(h_new.float(), h_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(c_new, c_ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad((h_new.float() * weights[0]).sum() + (c_new * weights[1]).sum(), (gates, c))
    refs = torch.autograd.grad((h_ref * weights[0]).sum() + (c_ref * weights[1]).sum(), (gates, c))
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    for grad, ref in zip(grads, refs):
        torch.testing.assert_close(grad.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lstm_cell_without_gradients_equals_the_training_cell(dtype):
    """Decoding's LSTM cell (sigmoid-based tanh) gives the training cell's h and c to rounding,
    h in the gates' dtype and c in fp32."""
    from nmt.kernels.lstm import lstm_cell

    gen = torch.Generator().manual_seed(0)
    gates, c = (torch.randn(7, 4 * 16, generator=gen) * 3).to(dtype), torch.randn(7, 16, generator=gen)
    h_train, c_train = lstm_cell(gates, c)
    with torch.no_grad():
        h_dec, c_dec = lstm_cell(gates, c)
    assert h_dec.dtype == dtype and c_dec.dtype == torch.float32
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(h_dec, h_train.detach(), **tol)
    torch.testing.assert_close(c_dec, c_train.detach(), **tol)




def _loss_and_grads(model, src, src_mask, tgt_in, autocast: bool = False):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(src, src_mask, tgt_in)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tgt_in.roll(-1, 1).flatten(), label_smoothing=0.1)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", VARIANTS)
def test_both_modes_compute_the_same_loss_and_gradients(name):
    """One model, its CPU kernels and the reference: the same loss and gradients in fp32 (no
    dropout), and close under bf16 autocast (the kernels round in other places)."""
    model = build(name).train()
    src, src_mask, tgt_in = batch(lengths=(7, 5, 3, 6))
    results = {}
    for mode in ("cpu", "reference"):
        model.set_kernels(mode)
        results[mode] = _loss_and_grads(model, src, src_mask, tgt_in)
        results[mode + "-bf16"] = _loss_and_grads(model, src, src_mask, tgt_in, autocast=True)
    torch.testing.assert_close(results["cpu"][0], results["reference"][0], atol=1e-5, rtol=1e-5)
    assert results["cpu"][1].keys() == results["reference"][1].keys()
    for key, grad in results["cpu"][1].items():
        torch.testing.assert_close(grad, results["reference"][1][key], atol=1e-5, rtol=1e-4, msg=key)
    torch.testing.assert_close(results["cpu-bf16"][0], results["reference-bf16"][0], atol=2e-2, rtol=2e-2)


def _module(model):
    from functools import partial

    from nmt.training.lit_module import TranslationModule

    return TranslationModule(model, optimizer=partial(torch.optim.Adam, lr=1e-3), label_smoothing=0.1)


@pytest.mark.parametrize("name", [pytest.param("lstm", marks=pytest.mark.slow), pytest.param("lstm_bahdanau", marks=pytest.mark.slow),
                                  "lstm_luong", "transformer"])  # a training run each: two by default, all four slow
def test_a_trained_model_gives_the_same_loss_and_greedy_output_in_both_modes(name):
    """Train a tiny model to reverse sequences (CPU kernels), then: the training loss of the
    module (fused output layer and loss, or ``F.cross_entropy``) agrees to fp tolerance, and
    greedy decoding gives the same tokens, in both modes."""
    from nmt.data.tokenizer import EOS, PAD
    from nmt.decoding.search import greedy_search

    model = build(name).set_kernels("cpu").train()
    module = _module(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)

    def reversal_batch(size: int = 32):
        lengths = torch.randint(2, 7, (size,), generator=gen)
        src = torch.full((size, 6), PAD)
        tgt_in = torch.full((size, 8), PAD)
        tgt_out = torch.full((size, 8), PAD)
        for i, n in enumerate(lengths.tolist()):
            words = torch.randint(4, VOCAB, (n,), generator=gen)
            src[i, :n] = words
            tgt_in[i, : n + 1] = torch.cat([torch.tensor([2]), words.flip(0)])
            tgt_out[i, : n + 1] = torch.cat([words.flip(0), torch.tensor([EOS])])
        return {"src": src, "src_mask": src != PAD, "tgt_in": tgt_in, "tgt_out": tgt_out}

    for _ in range(120):
        loss, _ = module.loss(reversal_batch())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    test = reversal_batch(64)
    results = {}
    with torch.no_grad():
        for mode in ("cpu", "reference"):
            model.set_kernels(mode)
            loss, nll = module.loss(test)
            hyps = greedy_search(model, test["src"], test["src_mask"], max_len_a=1.0, max_len_b=3)
            results[mode] = (loss, nll, hyps.tokens)
    assert results["cpu"][1] < 0.7 * math.log(VOCAB), "the model did not learn"  # (the plain LSTM learns least)
    torch.testing.assert_close(results["cpu"][0], results["reference"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["cpu"][1], results["reference"][1], atol=1e-5, rtol=1e-5)
    assert results["cpu"][2] == results["reference"][2]


def _recorded(calls: list, owner: str, name: str, fn):
    def record(self, *args, **kwargs):
        calls.append((owner, name))
        return fn(self, *args, **kwargs)

    return record


@pytest.mark.parametrize("name", VARIANTS)
def test_every_module_the_loss_and_decoding_follow_the_models_one_kernels(name, monkeypatch):
    """``Seq2Seq`` hands its one ``Kernels`` to every module with a choice, so changing its mode
    once moves them all, the training loss and decoding's log-probabilities with them: under
    ``reference`` every operation runs plain PyTorch, under ``cpu`` (and ``auto`` on a CPU) the
    same operations run the CPU kernels."""
    from nmt.decoding.search import greedy_search
    from nmt.kernels import CPUOps, ReferenceOps, UsesKernels

    model = build(name)
    users = [m for m in model.modules() if isinstance(m, UsesKernels)]
    assert len(users) > 2 and all(m.kernels is model.kernels for m in users)
    calls = []
    for cls in (ReferenceOps, CPUOps):
        for op, fn in list(vars(cls).items()):
            if callable(fn) and not op.startswith("_"):
                monkeypatch.setattr(cls, op, _recorded(calls, cls.__name__, op, fn))
    module = _module(model)
    src, src_mask, tgt_in = batch()
    data = {"src": src, "src_mask": src_mask, "tgt_in": tgt_in, "tgt_out": tgt_in.roll(-1, 1)}

    def ops_used(mode: str) -> set[tuple[str, str]]:
        model.kernels.mode = mode
        calls.clear()
        with torch.no_grad():
            module.loss(data)
            greedy_search(model, src, src_mask, max_len_a=1.0, max_len_b=2)
        return set(calls)

    reference, cpu, auto = ops_used("reference"), ops_used("cpu"), ops_used("auto")
    assert {owner for owner, _ in reference} == {"ReferenceOps"}
    assert {owner for owner, _ in cpu} == {owner for owner, _ in auto} == {"CPUOps"}
    used = {op for _, op in reference}
    assert used == {op for _, op in cpu} == {op for _, op in auto}
    assert {"dropout", "output_cross_entropy", "log_softmax"} <= used
    assert ("encoder_lstm" in used) == (type(model.encoder).__name__ == "RNNEncoder")
    assert ("decoder_lstm" in used) == (type(model.decoder).__name__ == "RNNDecoder")
    assert ("attention" in used) == ("Transformer" in type(model.encoder).__name__ + type(model.decoder).__name__)


def test_int8_is_a_mode_of_the_kernels_and_refuses_reference():
    """``quantize_int8`` switches the model's kernels to int8 (every module with them), which
    then refuse plain PyTorch; a model built alone starts at ``auto``."""
    import copy

    from nmt.kernels import CPUOps, Int8Ops, Kernels

    assert repr(Kernels()) == "Kernels(mode='auto', int8=False)"
    model = build("lstm_bahdanau")
    quantized = copy.deepcopy(model).quantize_int8()
    assert quantized.kernels.int8 and not model.kernels.int8
    assert quantized.encoder.kernels is quantized.kernels and quantized.decoder.attention.kernels is quantized.kernels
    assert isinstance(quantized.kernels.ops(torch.zeros(1)), Int8Ops)
    assert type(model.kernels.ops(torch.zeros(1))) is CPUOps
    with pytest.raises(ValueError, match="precision=int8 runs the CPU kernels: set kernels=auto or kernels=cpu, not reference"):
        quantized.set_kernels("reference")
    with pytest.raises(ValueError, match="kernels must be one of auto, reference, cpu, got 'fast'"):
        model.set_kernels("fast")


def test_an_lstm_under_cpu_autocast_runs_in_fp32_where_onednn_has_no_lower_precision_lstm(monkeypatch):
    """Without AVX-512, oneDNN has no bf16/fp16 LSTM and ``nn.LSTM`` under CPU autocast raises;
    ``lstm_call`` then runs it in fp32: the same numbers as without autocast, packed or not."""
    import nmt.kernels.reference as reference
    from torch.nn.utils.rnn import pack_padded_sequence

    monkeypatch.setattr(reference, "_onednn_lstm_has", lambda dtype: False)
    torch.manual_seed(0)
    rnn = torch.nn.LSTM(6, 5, num_layers=2, batch_first=True)
    x, hx = torch.randn(3, 4, 6), (torch.randn(2, 3, 5), torch.randn(2, 3, 5))
    packed = pack_padded_sequence(x, torch.tensor([4, 2, 3]), batch_first=True, enforce_sorted=False)
    plain = reference.lstm_call(rnn, x, hx)[0], reference.lstm_call(rnn, packed)[0].data
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            autocast = reference.lstm_call(rnn, x.to(dtype), tuple(s.to(dtype) for s in hx))[0], \
                reference.lstm_call(rnn, packed)[0].data
        assert all(a.dtype == torch.float32 for a in autocast)
        torch.testing.assert_close(autocast[1], plain[1], rtol=0, atol=0)
        torch.testing.assert_close(autocast[0], rnn(x.to(dtype).float(), tuple(s.to(dtype).float() for s in hx))[0], rtol=0, atol=0)


def test_cuda_attention_keeps_cudnn_out_unless_the_caller_chose_it():
    """``shape_free`` narrows SDPA on CUDA to the backends that need no per-shape plan, among those a
    caller's ``sdpa_kernel`` left enabled; the flags are process-wide, so this runs on any machine."""
    from torch.nn.attention import SDPBackend as B
    from torch.nn.attention import sdpa_kernel

    from nmt.kernels.sdpa import shape_free_backends

    assert shape_free_backends() == [B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH]
    with sdpa_kernel([B.CUDNN_ATTENTION]):
        assert shape_free_backends() is None  # cuDNN forced: kept
    with sdpa_kernel([B.FLASH_ATTENTION, B.CUDNN_ATTENTION]):
        assert shape_free_backends() is None  # flash alone cannot take a padding mask: the caller's choice stands
    with sdpa_kernel([B.EFFICIENT_ATTENTION, B.CUDNN_ATTENTION]):
        assert shape_free_backends() == [B.EFFICIENT_ATTENTION]
    with sdpa_kernel([B.MATH]):
        assert shape_free_backends() is None  # no cuDNN to keep out

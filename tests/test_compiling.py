"""compile=auto|true|false|cudagraphs (nmt.training.compiling): the compiled training pass against
eager, in losses, gradients, recompilations and the outputs of the trained weights.

Most tests trace with ``aot_eager`` (dynamo and AOT autograd, the graphs torch.compile builds,
without generating code: seconds instead of minutes on a CPU); the inductor test compiles the code a
GPU run compiles. The slow tier runs every model's parity; the default tier the choices and the self-check."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from nmt.data.batching import collate
from nmt.data.shapes import ShapeBuckets
from nmt.decoding.search import greedy_search
from nmt.training.compiling import CompilePlan, allow_recompiles, checked_loss, compile_counters, resolve_compile
from nmt.training.lit_module import TranslationModule
from tests.test_models import _built, build
from tests.test_shapes import items

MODELS = ["transformer", "lstm_luong", "lstm_bahdanau", "lstm_bahdanau_paper", "lstm"]


def test_auto_compiles_on_a_gpu_only_and_cudagraphs_needs_buckets():
    assert resolve_compile("auto", "cpu", "exact") is None
    assert resolve_compile("auto", "cuda", "buckets") == CompilePlan(dynamic=True, mode=None)
    assert resolve_compile("auto", "cuda", "exact") == CompilePlan(dynamic=True, mode=None)
    assert resolve_compile(True, "cpu", "exact") == CompilePlan(dynamic=True, mode=None)
    assert resolve_compile(False, "cuda", "buckets") is None
    assert resolve_compile("cudagraphs", "cuda", "buckets") == CompilePlan(dynamic=True, mode="reduce-overhead")
    with pytest.raises(ValueError, match=r"^compile=cudagraphs: a CUDA graph replays one shape, and data.shapes=exact"):
        resolve_compile("cudagraphs", "cuda", "exact")
    with pytest.raises(ValueError, match=r"^compile=cudagraphs: CUDA graphs need a GPU, and this run trains on cpu"):
        resolve_compile("cudagraphs", "cpu", "buckets")
    assert resolve_compile("trace", "cpu", "exact") == CompilePlan(dynamic=True, mode=None, backend="aot_eager")
    with pytest.raises(ValueError, match=r"^compile=fast: choose auto, true, false, cudagraphs, trace$"):
        resolve_compile("fast", "cuda", "buckets")


def test_a_gpu_without_triton_trains_eager_under_auto_and_refuses_an_explicit_compile(caplog):
    with caplog.at_level("INFO", logger="nmt.training.compiling"):
        assert resolve_compile("auto", "cuda", "buckets", gpu_compiler=False) is None
    assert "compile=auto: torch.compile cannot generate code for this GPU" in caplog.text
    for value in (True, "cudagraphs"):
        with pytest.raises(ValueError, match=r"torch.compile generates GPU code with Triton, which is not installed"):
            resolve_compile(value, "cuda", "buckets", gpu_compiler=False)
    assert resolve_compile("trace", "cuda", "buckets", gpu_compiler=False).backend == "aot_eager"


BATCHES = [[(9, 7), (6, 8), (4, 3), (9, 9), (2, 5)], [(10, 6), (7, 10), (3, 3), (5, 5), (11, 2)],
           [(30, 28), (25, 31), (27, 22)]]  # the first two share a bucketed shape, the third has its own


def pair(name: str, backend: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same weights twice (reference kernels, the GPU's), the second compiled as a run compiles
    it (dynamic shapes)."""
    _built["kernels"] = "reference"
    try:
        eager = build(name).train()
        compiled = build(name).train()
    finally:
        _built["kernels"] = "auto"
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_features(dynamic=True, backend=backend)
    return eager, compiled


def loss_and_grads(model: torch.nn.Module, batch: dict, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    module = TranslationModule(model, optimizer=functools.partial(torch.optim.Adam), label_smoothing=0.1)
    model.zero_grad()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = module.loss(batch)[0]
    loss.backward()
    return loss.detach().float(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def check_parity(name: str, backend: str, dtypes: tuple[torch.dtype | None, ...] = (None,)) -> None:
    allow_recompiles()
    torch.manual_seed(0)
    eager, compiled = pair(name, backend)
    graphs, shapes = compile_counters()["graphs"], set()
    for dtype in dtypes:
        tol = {"rtol": 1e-5, "atol": 1e-7} if dtype is None else {"rtol": 2e-2, "atol": 1e-3}
        for lengths in BATCHES:
            batch = collate(items(lengths, seed=len(lengths)), shapes=ShapeBuckets(4096))
            before = compile_counters()["graphs"]
            loss, grads = loss_and_grads(eager, batch, dtype)
            compiled_loss, compiled_grads = loss_and_grads(compiled, batch, dtype)
            torch.testing.assert_close(compiled_loss, loss, **tol)
            torch.testing.assert_close(compiled_grads, grads, rtol=tol["rtol"], atol=max(tol["atol"], 1e-6))
            shape = (dtype, *batch["src"].shape)
            if shape in shapes:  # a shape seen before compiles nothing
                assert compile_counters()["graphs"] == before
            shapes.add(shape)
    # at most one graph per batch shape and precision (dynamic shapes: fewer); the plain LSTM, nn.LSTM
    # calls alone (dynamo does not trace nn.LSTM; cuDNN runs them on a GPU), compiles nothing
    added = compile_counters()["graphs"] - graphs
    assert added == 0 if name == "lstm" else 1 <= added <= len(shapes)


@pytest.mark.slow  # a training pass compiled per model; the run-time self-check covers the default tier
@pytest.mark.parametrize("name", MODELS)
def test_compiled_training_pass_equals_eager_in_fp32_and_bf16(name):
    check_parity(name, "aot_eager", (None, torch.bfloat16))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["transformer", "lstm_luong"])
def test_trained_compiled_and_eager_weights_translate_alike(name):
    """Three Adam steps through each pass from the same weights: the same weights (fp32) and the
    same greedy translations."""
    torch.manual_seed(0)
    eager, compiled = pair(name, "aot_eager")
    for model in (eager, compiled):
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        for lengths in BATCHES:
            loss_and_grads(model, collate(items(lengths, seed=len(lengths)), shapes=ShapeBuckets(4096)))
            optimizer.step()
    for (key, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=key)
    src = collate(items([(7, 1), (5, 1), (3, 1)], seed=9))["src"]
    outputs = [greedy_search(m.eval(), src, src != 0).tokens for m in (eager, compiled)]
    assert outputs[0] == outputs[1]


def test_validation_and_decoding_stay_eager():
    """The compiled pass serves training only: in eval mode (validation loss) or without gradients
    nothing is compiled, so evaluation's exact shapes never add graphs."""
    eager, compiled = pair("transformer", "aot_eager")
    graphs = compile_counters()["graphs"]
    batch = collate(items(BATCHES[0]))
    with torch.no_grad():
        compiled.eval().features(batch["src"], batch["src_mask"], batch["tgt_in"])
        compiled.train().features(batch["src"], batch["src_mask"], batch["tgt_in"])
    assert compile_counters()["graphs"] == graphs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["transformer", "lstm_luong"])
def test_inductor_compiled_training_pass_equals_eager(name):
    check_parity(name, "inductor")


def test_a_wrong_compiled_pass_is_caught_on_the_first_batch_and_the_run_trains_eager(caplog):
    """The first training batch runs the eager pass beside the compiled one, from the same random
    state: a right compiled pass (here the eager function itself, standing for one) agrees, keeps
    training compiled and leaves the random state where one pass leaves it; a wrong one (its
    features times 50) logs one warning, and that batch and the later ones train eager."""
    from nmt.models.base import teacher_forced

    model = build("transformer").train()
    module = TranslationModule(model, optimizer=functools.partial(torch.optim.Adam), label_smoothing=0.1)
    module.log = lambda *args, **kwargs: None
    module._is_finite = lambda loss: True
    batch = collate(items(BATCHES[0]))
    torch.manual_seed(5)
    eager = module.loss(batch)[0]
    after_one = torch.get_rng_state()

    model._compiled_features = teacher_forced
    torch.manual_seed(5)
    loss = checked_loss(model, lambda: module.losses(batch))[0]
    assert torch.equal(loss, eager) and loss.requires_grad and model.compiled
    assert torch.equal(torch.get_rng_state(), after_one)

    calls = []

    def wrong(m, src, src_mask, tgt_in, *rest):
        calls.append(1)
        return teacher_forced(m, src, src_mask, tgt_in) * 50

    model._compiled_features = wrong
    torch.manual_seed(5)
    with caplog.at_level("WARNING", logger="nmt.training.compiling"):
        first = module.training_step(batch, 0)
        module.training_step(batch, 1)
    assert torch.equal(first.detach(), eager.detach()) and first.requires_grad
    assert not model.compiled and len(calls) == 1
    [record] = caplog.records
    assert re.fullmatch(r"compile: the compiled training pass's first loss [\d.]+ differs from the eager pass's [\d.]+ "
                        r"by [\d.]+ \(relative; tolerance 0.05\); training runs eager from here on", record.getMessage())
